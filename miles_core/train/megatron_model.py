"""Megatron-core GPTModel for the supported HF families, and its training wrapper.

`ModelSpec.from_hf_config(config.json dict)` reads the family and shapes of an HF checkpoint;
`build_model(spec)` builds the matching `GPTModel` with the local layer spec:
- llama / qwen2 / qwen3: RMSNorm, SwiGLU (fc1 = [gate; up]), GQA, RoPE with the checkpoint's theta
  (Llama 3.1's `llama3` scaling: `rope_inv_freq`), qkv bias for Qwen2, q/k norms and a head_dim of
  its own for Qwen3, tied or untied embeddings;
- qwen3_moe / glm4_moe: the same attention (GLM: partial rotary, qkv bias, optional q/k norms) and
  a MoE layer or a dense MLP per layer (`layer_specs`), with the router `moe_options` describes;
  the load-balancing aux loss reaches the trainer's loss through `scale_moe_aux_loss` and its
  value through `moe_aux_loss_value` (train/moe_aux_loss);
- gpt2: LayerNorm, gelu (tanh approximation, HF's `gelu_new`), biases everywhere, learned absolute
  positions (`position_embedding_type="learned_absolute"`, docs/quickstart.md), tied embeddings.
`build_model(spec, train=section)` also applies --recompute-* and --sequence-parallel
(`activation_options`); under sequence parallelism the norms are `SequenceParallelTorchNorm` and
`masked_token_logprobs` pads the sequence to a multiple of TP and gathers the final hidden states.
On CPU the model is built with `use_cpu_initialization=True` in fp32 behind the CPU shim; on GPU
in bf16 wrapped in Megatron DDP with Megatron's mixed-precision (not distributed) optimizer
(`build_gpu_training`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from miles_core.config.rules import recompute_layers_problem
from miles_core.models.families import FAMILIES, ModelSpec, UnsupportedModel  # noqa: F401 - re-exported
from miles_core.models.families.rope import rope_inv_freq
from miles_core.train.cpu_shim import (define_missing_te_names, install_cpu_shim, megatron_on_cpu,
                                      seed_model_parallel_rng)
from miles_core.train.process_groups import DEFAULT_TIMEOUT_MINUTES, ensure_process_groups
from miles_core.train.token_logprobs import token_logprobs

FAMILIES = ("gpt2",) + FAMILIES  # the builtin tiny default's and every one a user may bring


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATION_FLAGS = ("sequence_parallel", "recompute_granularity", "recompute_method", "recompute_num_layers")


def activation_options(train) -> dict[str, Any]:
    """`transformer_config`'s keywords from a TrainSection's --sequence-parallel and --recompute-*
    flags (None: none of them)."""
    return {name: getattr(train, name) for name in ACTIVATION_FLAGS} if train is not None else {}


def transformer_config(spec: ModelSpec, *, tensor_model_parallel_size: int = 1, bf16: bool = False,
                       sequence_parallel: bool = False, recompute_granularity: str | None = None,
                       recompute_method: str | None = None, recompute_num_layers: int | None = None,
                       expert_model_parallel_size: int = 1, moe_aux_loss_coeff: float | None = None):
    """Megatron's TransformerConfig for `spec`: its own checks refuse an inconsistent --recompute-*
    combination or --sequence-parallel without TP (config.rules refuses them earlier, by flag).
    `moe_aux_loss_coeff`: Megatron's own coefficient (per MoE layer, summed), overriding the one
    derived from the checkpoint (`moe_options`)."""
    from megatron.core.transformer import TransformerConfig

    problem = recompute_layers_problem(spec.num_layers, recompute_method, recompute_num_layers)
    if problem:
        raise ValueError(problem)
    if spec.moe and tensor_model_parallel_size > 1 and not sequence_parallel:
        raise UnsupportedModel(f"a mixture-of-experts model ({spec.family}) with --tensor-model-parallel-size="
                               f"{tensor_model_parallel_size} needs --sequence-parallel: Megatron's MoE layer does "
                               "not train tensor-parallel without it")
    gpt2 = spec.family == "gpt2"
    cpu = not torch.cuda.is_available()
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, ffn_hidden_size=spec.ffn_hidden_size,
        kv_channels=spec.head_dim, layernorm_epsilon=spec.norm_eps, qk_layernorm=spec.qk_norm,
        normalization="LayerNorm" if gpt2 else "RMSNorm",
        activation_func=_gelu_tanh if gpt2 else F.silu, gated_linear_unit=not gpt2,
        add_bias_linear=gpt2, add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,  # RL fine-tuning: log-probs must match the engine's
        tensor_model_parallel_size=tensor_model_parallel_size, sequence_parallel=sequence_parallel,
        recompute_granularity=recompute_granularity, recompute_method=recompute_method,
        recompute_num_layers=recompute_num_layers,
        use_cpu_initialization=cpu, perform_initialization=True,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        # The loss is already divided by the global token count: DDP must sum gradients, not average.
        calculate_per_token_loss=True,
        # Fusions need CUDA kernels (or Apex/TE); the local spec runs the unfused paths.
        bias_dropout_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        cuda_graph_scope=[],  # Megatron's default "full", spelled as it asks (its "full scope is deprecated")
        **moe_options(spec, expert_model_parallel_size, moe_aux_loss_coeff),
    )


def moe_options(spec: ModelSpec, expert_model_parallel_size: int = 1,
                aux_loss_coeff: float | None = None) -> dict[str, Any]:
    """TransformerConfig's MoE keywords for `spec` (none for a dense model), each chosen so Megatron's
    router computes what transformers' does:

    - softmax router (qwen3_moe): Megatron's default takes the top-k of the logits and softmaxes
      those k, i.e. the chosen weights renormalised (HF's norm_topk_prob=true); with
      `moe_router_pre_softmax` it softmaxes over every expert first and keeps the k unnormalised
      weights (norm_topk_prob=false);
    - sigmoid router (glm4_moe): sigmoid scores, the expert bias (GLM's e_score_correction_bias, a
      checkpoint weight: update rate 0, so training leaves it as loaded and exports it back) added
      for the choice only, grouped top-k, the chosen weights renormalised (Megatron always does for
      k > 1, so norm_topk_prob=false is refused) and scaled by routed_scaling_factor;
    - the load-balancing aux loss (qwen3_moe's router_aux_loss_coef): Megatron's per-layer loss is
      transformers' `load_balancing_loss_func` of that layer's router logits divided by top-k, and
      Megatron sums it over the MoE layers; the coefficient router_aux_loss_coef * topk / MoE layers
      makes the term added to the loss router_aux_loss_coef x the mean over MoE layers of
      transformers' per-layer value (for one MoE layer: exactly transformers' aux loss term).
      `aux_loss_coeff` (--moe-aux-loss-coeff) is Megatron's coefficient as given.
    Routing runs in fp32 (as GLM's HF router does; a bf16 router flips near-ties); the experts are
    SequentialMLP (`moe_grouped_gemm=False`: one local MLP per expert, the canonical names)."""
    if not spec.moe:
        return {}
    softmax = spec.router_score == "softmax"
    if not softmax and not spec.norm_topk_prob and spec.moe_topk > 1:
        raise UnsupportedModel(f"{spec.family} norm_topk_prob=false with a sigmoid router is not supported: "
                               "Megatron renormalises the chosen experts' sigmoid scores")
    if softmax and spec.norm_topk_prob and spec.moe_topk == 1:
        raise UnsupportedModel(f"{spec.family} num_experts_per_tok=1 with norm_topk_prob=true is not supported "
                               "(every token's weight would be 1; Megatron needs the softmax before top-1)")
    if aux_loss_coeff is None:
        aux_loss_coeff = spec.aux_loss_coef * spec.moe_topk / len(spec.moe_layers) if spec.moe_layers else 0.0
    return dict(
        num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_topk, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size or None,
        moe_layer_freq=[int(spec.is_moe_layer(i)) for i in range(spec.num_layers)],
        moe_router_score_function=spec.router_score,
        moe_router_pre_softmax=softmax and not spec.norm_topk_prob,
        moe_router_enable_expert_bias=spec.expert_bias, moe_router_bias_update_rate=0.0,
        moe_router_topk_scaling_factor=spec.routed_scaling_factor if spec.routed_scaling_factor != 1.0 else None,
        moe_router_num_groups=spec.router_groups or None, moe_router_group_topk=spec.router_group_topk or None,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff else "none", moe_aux_loss_coeff=aux_loss_coeff,
        moe_router_dtype="fp32", moe_grouped_gemm=False, moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=expert_model_parallel_size,
    )


def build_model(spec: ModelSpec, *, tensor_model_parallel_size: int = 1, bf16: bool = False, seed: int = 1,
                train=None, expert_model_parallel_size: int = 1, moe_aux_loss_coeff: float | None = None):
    """A `GPTModel` for `spec` (weights random until the converter loads a checkpoint); `train`: the
    TrainSection whose --sequence-parallel and --recompute-* apply (`activation_options`).
    `expert_model_parallel_size`: the EP size the process groups and the MoE layers are built for."""
    from megatron.core.models.gpt import GPTModel

    install_cpu_shim()
    define_missing_te_names()
    _ensure_groups(tensor_model_parallel_size, expert_model_parallel_size, train)
    seed_model_parallel_rng(seed)
    cfg = transformer_config(spec, tensor_model_parallel_size=tensor_model_parallel_size, bf16=bf16,
                             expert_model_parallel_size=expert_model_parallel_size,
                             moe_aux_loss_coeff=moe_aux_loss_coeff, **activation_options(train))
    impl = transformer_impl(getattr(train, "transformer_impl", "auto"))
    gpt2 = spec.family == "gpt2"
    model = GPTModel(
        cfg, layer_specs(cfg, impl), vocab_size=spec.vocab_size, max_sequence_length=spec.max_positions,
        position_embedding_type="learned_absolute" if gpt2 else "rope",
        rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
        rotary_percent=spec.rotary_fraction,
        share_embeddings_and_output_weights=spec.tied_embeddings,
        parallel_output=False,  # full-vocab logits on every TP rank: the loss needs log-softmax over all of it
    )
    if spec.positions == "rope":
        model.rotary_pos_emb.inv_freq = rope_inv_freq(spec)
    model.miles_transformer_impl = impl  # forward_hidden passes packed rows to TE as THD
    mark_qk_norms(model, tensor_model_parallel_size)
    if spec.moe:  # Megatron's aux-loss tracker is global, sized by the first model's layers: a new model starts it anew
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
    for router in routers(model):  # the aux loss is weighted per micro-batch by `scale_moe_aux_loss`
        router.calculate_per_token_loss = False
    if bf16:  # as Megatron's Float16Module does: the torch norms (no Apex/TE) are built in fp32
        model = model.bfloat16()
        for router in routers(model):
            router._maintain_float32_expert_bias()  # GLM's bias stays fp32, as Megatron keeps it
    if torch.cuda.is_available():
        model = model.cuda()
    return model


def _ensure_groups(tp: int, ep: int, train=None) -> None:
    """The process groups for TP and EP, with `train`'s --distributed-timeout-minutes (else the default)."""
    timeout = train.distributed_timeout_minutes if train is not None else DEFAULT_TIMEOUT_MINUTES
    ensure_process_groups(tp, expert_model_parallel_size=ep, timeout_minutes=timeout)


def layer_specs(cfg, impl: str):
    """The decoder's spec: one layer spec for every layer of a dense model (its norms
    `SequenceParallelTorchNorm` under sequence parallelism), or a block spec with a MoE layer
    (`moe_layer_freq`) or a dense one per layer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                              get_gpt_layer_with_transformer_engine_spec)

        if cfg.num_moe_experts:
            return get_gpt_decoder_block_spec(cfg, use_transformer_engine=True)
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_layernorm)

    def local(experts):
        return sequence_parallel_layer(get_gpt_layer_local_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=cfg.qk_layernorm,
            normalization=cfg.normalization), cfg)

    dense = local(None)
    norm = dense.submodules.input_layernorm  # SequenceParallelTorchNorm under sequence parallelism
    if not cfg.num_moe_experts and norm is not SequenceParallelTorchNorm:
        return dense
    moe = local(cfg.num_moe_experts) if cfg.num_moe_experts else dense
    pattern = cfg.moe_layer_freq if cfg.num_moe_experts else [0] * cfg.num_layers
    return TransformerBlockSubmodules(layer_specs=[moe if m else dense for m in pattern], layer_norm=norm)


def routers(model) -> list:
    """The MoE routers of a model (empty for a dense one), in layer order."""
    from megatron.core.transformer.moe.router import Router

    return [m for m in unwrap(model).modules() if isinstance(m, Router)]


LOAD_BALANCING = "load_balancing_loss"  # Megatron's aux-loss tracker entry (moe_utils.save_to_aux_losses_tracker)


def has_moe_aux_loss(model) -> bool:
    """Whether the model's MoE routers add a load-balancing loss (a MoE model, coefficient > 0)."""
    cfg = unwrap(model).config
    return bool(cfg.num_moe_experts) and bool(cfg.moe_aux_loss_coeff)


def scale_moe_aux_loss(weight: float) -> None:
    """The weight of the load-balancing loss in the next backward. Megatron's routers attach the
    loss to their output (`MoEAuxLossAutoScaler`), whose backward adds coefficient x weight x its
    gradient; `build_model` turns off their per-token scaling (which expects Megatron's own
    division of every gradient by the token count), so the trainer weighs each micro-batch's loss
    as it weighs its tokens: micro-batch loss tokens / the global batch's. Summed over the
    micro-batches and the DP ranks, the aux term is the token-weighted mean of the micro-batches'."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    device = "cuda" if torch.cuda.is_available() else "cpu"
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(weight), device=device))


def moe_aux_loss_value(model) -> float | None:
    """The load-balancing loss of the training forwards since the last call (then reset), in
    transformers' units (`load_balancing_loss_func` of one layer's router logits: Megatron's
    tracked value x top-k), averaged over the MoE layers; None when the model adds none. Under
    sequence parallelism each TP rank holds a part of every layer's sum: summed over the TP group."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    if not has_moe_aux_loss(model):
        return None
    cfg = unwrap(model).config
    entry = get_moe_layer_wise_logging_tracker().get(LOAD_BALANCING)
    if entry is None:
        return 0.0
    layers = [i for i, moe in enumerate(cfg.moe_layer_freq) if moe]
    value = entry["values"][layers].sum() * cfg.moe_router_topk / len(layers)
    entry["values"].zero_()
    if cfg.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
        from miles_core.train import collectives

        value = collectives.all_reduce(value.reshape(1), ps.get_tensor_model_parallel_group())[0]
    return float(value)


def mark_qk_norms(model, tp: int) -> None:
    """Under TP each rank holds some of the heads, so the q/k norms' weights (one per head dim, shared by
    every head) get a partial gradient on each rank, sequence parallelism or not: marked
    `sequence_parallel` they are summed over the TP group like the layer norms under it
    (`data_parallel.all_reduce_sequence_parallel_grads`; Megatron's `finalize_model_grads` sums them
    by name, once either way)."""
    if tp > 1:
        for name, p in model.named_parameters():
            if "q_layernorm" in name or "k_layernorm" in name:
                p.sequence_parallel = True


def transformer_engine_available() -> bool:
    """Transformer Engine can build the layers here: a GPU, and the package importable."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def transformer_impl(requested: str) -> str:
    """--transformer-impl resolved: auto = transformer_engine where it is available, else local."""
    if requested == "auto":
        return "transformer_engine" if transformer_engine_available() else "local"
    if requested == "transformer_engine" and not transformer_engine_available():
        raise UnsupportedModel("--transformer-impl=transformer_engine needs a GPU and the transformer_engine "
                               "package on the trainer's nodes; use --transformer-impl local (or auto)")
    return requested


class SequenceParallelTorchNorm:
    """Megatron's `WrappedTorchNorm` (torch LayerNorm / RMSNorm: the local spec's norm without Apex,
    always on CPU) under sequence parallelism, which WrappedTorchNorm refuses (an assert) only because
    it does not mark its parameters. Each TP rank then normalises its own slice of the sequence, so
    the weight's (and bias's) gradient is a partial sum over that slice: marked `sequence_parallel`,
    as Megatron's own norms do, it is summed over the TP group before the optimizer step
    (`data_parallel.all_reduce_sequence_parallel_grads`; Megatron's `finalize_model_grads`)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def sequence_parallel_layer(layer_spec, cfg):
    """`layer_spec` as is, or under sequence parallelism with torch norms (no Apex) with its layer
    norms `SequenceParallelTorchNorm` (state-dict keys unchanged; `layer_specs` builds the block), and
    the q/k norms too (Qwen3's): WrappedTorchNorm refuses sequence parallelism, and each TP rank's
    gradient of them is a partial sum over its own heads, summed over TP as the marked norms' are."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if not cfg.sequence_parallel or layer_spec.submodules.input_layernorm is not WrappedTorchNorm:
        return layer_spec
    norms = dict(input_layernorm=SequenceParallelTorchNorm, pre_mlp_layernorm=SequenceParallelTorchNorm)
    attention = layer_spec.submodules.self_attention
    qk = {n: SequenceParallelTorchNorm for n in ("q_layernorm", "k_layernorm")
          if getattr(attention.submodules, n, None) is WrappedTorchNorm}
    if qk:
        norms["self_attention"] = dataclasses.replace(attention,
                                                      submodules=dataclasses.replace(attention.submodules, **qk))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, **norms))


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """Megatron's explicit attention mask: True where attention is *not* allowed."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)


def forward_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """[batch, seq] token ids -> [batch, seq, vocab] logits (right padding needs no extra mask)."""
    b, s = tokens.shape
    positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    return model(tokens, positions, causal_mask(s, tokens.device))


def forward_hidden(model, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[batch, seq] token ids -> [seq, batch, hidden] final hidden states (after the final norm):
    the model's forward without its output layer, for `masked_token_logprobs`.

    Default: positions 0..seq-1 and the causal mask (right-padded rows). A packed row
    (miles_core.train.packing) passes its own `position_ids` [batch, seq] (read by learned absolute
    positions; RoPE rotates by the index in the row) and block-diagonal `attention_mask`
    [1 or batch, 1, seq, seq] (bool, True = not allowed). The local spec's attention honours an
    explicit mask although its attn_mask_type is causal: Megatron's `FusedScaleMaskSoftmax`
    builds the causal mask only when none is passed (fusions/fused_softmax.py, `forward_torch_softmax`;
    the fused kernel is off: `masked_softmax_fusion=False`).

    Under Transformer Engine's layer spec a packed row goes as THD instead (`thd_params`): TE's
    attention ignores an explicit mask.

    GPTModel's `_postprocess` returns the decoder's output as is when `post_process` is off (what a
    pipeline stage before the last does); the decoder keeps its own final layernorm."""
    b, s = tokens.shape
    packed = attention_mask is not None
    if position_ids is None:
        position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    if attention_mask is None:
        attention_mask = causal_mask(s, tokens.device)
    gpt = unwrap(model)
    if not gpt.post_process:
        raise ValueError("forward_hidden needs the model's last pipeline stage (post_process=True)")
    extra = {}
    if packed and getattr(gpt, "miles_transformer_impl", "local") == "transformer_engine":
        extra["packed_seq_params"], attention_mask = thd_params(position_ids), None
    gpt.post_process = False
    try:
        return model(tokens, position_ids, attention_mask, **extra)
    finally:
        gpt.post_process = True


def thd_params(position_ids: torch.Tensor):
    """Transformer Engine's view of a packed row [1, T]: the samples' boundaries (where the position
    ids restart at 0) as `PackedSeqParams(qkv_format="thd")`; TE then masks each sample causally and
    Megatron rotates RoPE per sample (cu_seqlens)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    row = position_ids[0]
    starts = (row == 0).nonzero().flatten()
    ends = torch.cat([starts[1:], torch.tensor([row.numel()], device=row.device)])
    cu = torch.cat([starts[:1] * 0, ends]).to(torch.int32)
    longest = int((ends - starts).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def output_shard(model) -> tuple[torch.Tensor, int]:
    """(this TP rank's output-layer weight [vocab / tp, hidden], the first vocabulary id of its rows).

    The weight is the word embedding when they are tied (`share_embeddings_and_output_weights`)."""
    from megatron.core import parallel_state as ps

    gpt = unwrap(model)
    if gpt.output_layer.bias is not None:
        raise ValueError("an output layer with a bias is not supported by masked_token_logprobs")
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
        else gpt.output_layer.weight
    return weight, ps.get_tensor_model_parallel_rank() * weight.shape[0]


def masked_token_logprobs(model, tokens: torch.Tensor, mask: torch.Tensor, chunk_rows: int | None = None, *,
                          position_ids: torch.Tensor | None = None,
                          attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each next token, entropy), both [batch, seq - 1] fp32, where `mask` [batch, seq - 1]
    is non-zero, 0 elsewhere: the output layer runs on those positions only, chunk by chunk, over
    the vocab-parallel shards (miles_core.train.token_logprobs); no full-vocabulary logits.
    `position_ids` / `attention_mask`: a packed row's (`forward_hidden`); default: right-padded rows."""
    from megatron.core import parallel_state as ps

    padded = sequence_parallel_padding(model, tokens, position_ids, attention_mask)
    hidden = whole_sequence(model, forward_hidden(model, *padded), tokens.shape[1])  # [seq, batch, hidden]
    rows, cols = mask.nonzero(as_tuple=True)
    weight, vocab_start = output_shard(model)
    tp_group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    logp, entropy = token_logprobs(hidden[cols, rows], weight, tokens[rows, cols + 1], tp_group=tp_group,
                                   vocab_start=vocab_start, chunk_rows=chunk_rows)

    def scatter(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).index_put((rows, cols), values)

    return scatter(logp), scatter(entropy)


def sequence_parallel_padding(model, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                              attention_mask: torch.Tensor | None = None) -> tuple:
    """(tokens, position_ids, attention_mask) right-padded to a multiple of the TP size under sequence
    parallelism (Megatron scatters the sequence over the TP ranks after the embedding, so each rank
    needs an equal slice); as given otherwise. The padding comes after every real token, so under the
    (causal or given) mask no real position attends to it; `whole_sequence` drops it again."""
    cfg = unwrap(model).config
    extra = -tokens.shape[1] % cfg.tensor_model_parallel_size if cfg.sequence_parallel else 0
    if not extra:
        return tokens, position_ids, attention_mask
    padded = tokens.shape[1] + extra
    if attention_mask is not None:  # the given mask on the real positions, causal on the padding
        grown = causal_mask(padded, tokens.device).repeat(attention_mask.shape[0], 1, 1, 1)
        grown[..., :tokens.shape[1], :tokens.shape[1]] = attention_mask
        attention_mask = grown
    position_ids = F.pad(position_ids, (0, extra)) if position_ids is not None else None
    return F.pad(tokens, (0, extra)), position_ids, attention_mask


def whole_sequence(model, hidden: torch.Tensor, seq_len: int) -> torch.Tensor:
    """`forward_hidden`'s output [seq_len, batch, hidden] on every TP rank: under sequence parallelism
    it is this rank's slice of the padded sequence, all-gathered here, the padding dropped.

    The gather's backward is a split (`tensor_parallel_output_grad=False`), not the reduce-scatter of
    Megatron's column-parallel layer: `token_logprobs` already all-reduces the gradient of the rows it
    reads over the TP group (its copy-to region), so the gradient arrives here complete and identical
    on every rank; a reduce-scatter would count it TP times."""
    if unwrap(model).config.sequence_parallel:
        from megatron.core import tensor_parallel

        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
    return hidden[:seq_len]


def unwrap(model):
    """The GPTModel inside a Megatron DDP wrapper (or the model itself)."""
    return getattr(model, "module", model)


def build_training(model, *, lr: float, weight_decay: float, clip_grad: float, bf16: bool,
                   distributed_optimizer: bool):
    """Megatron DDP (summing gradients over DP, `calculate_per_token_loss`) + Megatron's Adam:
    `Float16OptimizerWithFloat16Params` (fp32 main params) under bf16, `FP32Optimizer` otherwise,
    `DistributedOptimizer` (main params and Adam moments sharded over DP, ZeRO-1) with
    `distributed_optimizer`, in a `ChainedOptimizer`. The GPU trainer's path; on CPU it runs inside
    `megatron_on_cpu` (cpu_shim). Returns (ddp_model, optimizer); `optimizer.step()` returns
    (ok, grad_norm, zeros)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=distributed_optimizer,
                                            average_in_collective=False)
    opt_cfg = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, bf16=bf16,
                              clip_grad=clip_grad, use_distributed_optimizer=distributed_optimizer,
                              adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8)
    with megatron_on_cpu():
        ddp_model = DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model)
        optimizer = get_megatron_optimizer(opt_cfg, [ddp_model])
    return ddp_model, optimizer
