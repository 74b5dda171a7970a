"""A compact torch forward for the causal LMs the CPU engine serves, with a slot-based KV cache.

The model is described by the shared `ModelSpec` (miles_core.models.families: one adapter per
family reads config.json; docs/models.md lists the families) and read straight from an HF-format
directory (config.json + safetensors), by the HF names its family's tensor map lists:
- `gpt2`: learned absolute positions, LayerNorm, fused c_attn (Conv1D weights are [in, out]), gelu_new;
- the llama-like families (`llama`, `qwen2`, `qwen3`, `qwen3_moe`, `glm4_moe`): RoPE (default or
  Llama 3.1's `llama3` scaling; partial rotary: only each head's first `rotary_dim` dims, GLM), RMSNorm,
  GQA, SwiGLU, q/k/v biases (qwen2, GLM's attention_bias), an RMSNorm over each head's q and k before
  RoPE (qwen3, qwen3_moe, GLM's use_qk_norm) and a head_dim of its own; MoE layers (`spec.moe_layers`)
  with a softmax top-k router (qwen3_moe) or a sigmoid one whose expert-score correction bias enters
  the choice only, grouped top-k, the chosen weights renormalised (`norm_topk_prob`) and scaled
  (`routed_scaling_factor`), and shared experts (glm4_moe). Each computation follows transformers'
  modeling code for the family, in the same order, so float32 logits agree to rounding.

Routed experts: after each `prefill` / `decode`, `last_routes` holds the top-k expert ids each token
was routed to in each MoE layer ([N, T, MoE layers, k] / [B, MoE layers, k], int32, in the order of
`spec.moe_layers`; None for a dense model): what SGLang returns as `routed_experts` (the server
lays them out as SGLang does, miles_core.engines.cpu_server).

The cache holds one row ("slot") per running request: `[layers, 2, slots, kv_heads, positions, head_dim]`.
The caller keeps running requests in slots 0..B-1 (it compacts when requests leave), so a decode step
reads a view of the cache and never gathers. Everything is float32: the engine's log-probs must match a
float32 teacher-forced forward pass of the trainer within 1e-4.

transformers is deliberately not imported: it costs seconds of start-up per engine process and a
restarted engine should be back quickly.
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F

from miles_core.models.families import ADAPTERS, FAMILIES, ModelSpec, UnsupportedModel, spec_of
from miles_core.models.families.rope import rope_inv_freq
from miles_core.models.safetensors_dir import MissingWeights, load_safetensors_dir

__all__ = ["CausalLM", "ModelLoadError", "ModelSpec", "fused_layout", "read_eos_token_ids", "read_safetensors",
           "read_spec", "spec_from_config"]

_PREFIXES = ("model.", "transformer.")  # HF's base-model prefixes; a checkpoint may be saved with or without


class ModelLoadError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


def spec_from_config(cfg: dict, source: str) -> ModelSpec:
    """The shared `ModelSpec` of a config.json dict (its family's adapter); ModelLoadError names what the
    CPU engine cannot serve (the adapter's refusal: the field, its value and what is handled)."""
    try:
        return spec_of(cfg)
    except UnsupportedModel as e:
        raise ModelLoadError(f"{source}: {e} by the CPU engine (it serves {', '.join(FAMILIES)} and the "
                             "builtin gpt2); serve other models with --engine-backend sglang.") from e
    except KeyError as e:
        raise ModelLoadError(f"{source}: config.json lacks {e} (model_type={cfg.get('model_type')!r}).") from e


def _read_config(model_dir: str) -> tuple[dict, str]:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            return json.load(f), path
    except FileNotFoundError as e:
        raise ModelLoadError(f"{path}: no config.json; --model-path must be an HF-format model directory.") from e


def read_spec(model_dir: str) -> ModelSpec:
    cfg, path = _read_config(model_dir)
    return spec_from_config(cfg, path)


def _eos_list(eos) -> list[int]:
    return [int(t) for t in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]


def read_eos_token_ids(model_dir: str) -> tuple[int, ...]:
    """EOS ids as SGLang gathers them: config.json's `eos_token_id` plus generation_config.json's (an
    int or a list in either), in that order, without repeats. (The shared ModelSpec describes the
    network only; the engine reads the EOS ids here.)"""
    ids = _eos_list(_read_config(model_dir)[0].get("eos_token_id"))
    try:
        with open(os.path.join(model_dir, "generation_config.json")) as f:
            extra = _eos_list(json.load(f).get("eos_token_id"))
    except (FileNotFoundError, json.JSONDecodeError):
        extra = []
    for t in extra:
        if t not in ids:
            ids.append(t)
    return tuple(ids)


def read_safetensors(model_dir: str, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The directory's tensors in float32. A tensor for which `into` holds a float32 buffer of the same shape
    is converted straight into it (one pass over the memory-mapped file, no new allocation: a staged load
    into buffers already in memory costs a sixth of one that allocates, measured on SmolLM2-135M)."""
    try:
        tensors = load_safetensors_dir(model_dir)
    except MissingWeights as e:
        raise ModelLoadError(f"{e} (the CPU engine reads safetensors only).") from e
    into = into or {}
    out = {}
    for k, v in tensors.items():
        dst = into.get(k)
        out[k] = dst.copy_(v) if dst is not None and dst.shape == v.shape and dst.dtype == torch.float32 else v.float()
    return out


class CausalLM:
    """Weights of one model plus `prefill` and `decode` over a slot-based KV cache (no autograd).

    `eos_token_ids`: what the batching engine stops on when it is not given its own (`load` reads
    config.json's and generation_config.json's)."""

    def __init__(self, spec: ModelSpec, tensors: dict[str, torch.Tensor], source: str = "?",
                 eos_token_ids: tuple[int, ...] = ()):
        self.spec = spec
        self.eos_token_ids = tuple(eos_token_ids)
        self.last_routes: torch.Tensor | None = None  # top-k expert ids of the last prefill/decode (MoE)
        _check_shapes(spec, tensors, source)
        try:
            self.layers, self.top = (_gpt2_weights if spec.family == "gpt2" else _llama_weights)(spec, tensors)
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing tensor {e.args[0]!r} for a {spec.family} model.") from e
        if spec.positions == "rope":
            freqs = torch.outer(torch.arange(spec.max_positions, dtype=torch.float32), rope_inv_freq(spec))
            self.cos, self.sin = freqs.cos(), freqs.sin()  # [positions, rotary_dim / 2]

    @staticmethod
    def load(model_dir: str) -> "CausalLM":
        spec = read_spec(model_dir)
        return CausalLM(spec, read_safetensors(model_dir), model_dir, read_eos_token_ids(model_dir))

    def same_architecture(self, other: "CausalLM") -> bool:
        """Whether `other` fits this model's KV cache and routed-expert layout (a weight update may swap it in)."""
        a, b = self.spec, other.spec
        key = lambda s: (s.family, s.vocab_size, s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads,  # noqa: E731
                         s.head_dim, s.num_experts, s.moe_topk, s.moe_layers)
        return key(a) == key(b)

    # ---- forward -------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, cache: torch.Tensor, first_slot: int, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Run right-padded `tokens` [N, T] from position 0, write their K/V into slots
        first_slot..first_slot+N-1, return the logits at each row's last real position [N, vocab].
        A MoE model leaves every position's routed experts in `last_routes` [N, T, MoE layers, k]."""
        n, t = tokens.shape
        pos = torch.arange(t)
        x = self._embed(tokens, pos.expand(n, t))
        rows = slice(first_slot, first_slot + n)
        routes: list[torch.Tensor] = []
        for li, w in enumerate(self.layers):
            q, k, v = self._qkv(w, x, pos.expand(n, t))  # [N, heads, T, hd]
            cache[li, 0, rows, :, :t] = k
            cache[li, 1, rows, :, :t] = v
            attn = _causal_attention(q, k, v, self.spec.num_heads // self.spec.num_kv_heads)
            x = self._finish_layer(w, x, attn, routes)
        self.last_routes = torch.stack(routes, dim=-2) if routes else None
        last = x[torch.arange(n), lengths - 1]
        return self._logits(last)

    @torch.inference_mode()
    def decode(self, cache: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per running request in slots 0..B-1 at `positions` [B]; returns logits [B, vocab].
        A MoE model leaves the tokens' routed experts in `last_routes` [B, MoE layers, k]."""
        b = tokens.shape[0]
        x = self._embed(tokens[:, None], positions[:, None])
        span = int(positions.max()) + 1
        rows = torch.arange(b)
        mask = (torch.arange(span)[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, span]
        gqa = self.spec.num_kv_heads != self.spec.num_heads
        routes: list[torch.Tensor] = []
        for li, w in enumerate(self.layers):
            q, k, v = self._qkv(w, x, positions[:, None])  # [B, heads, 1, hd]
            cache[li, 0, rows, :, positions] = k[:, :, 0]
            cache[li, 1, rows, :, positions] = v[:, :, 0]
            kc, vc = cache[li, 0, :b, :, :span], cache[li, 1, :b, :, :span]  # [B, kvh, span, hd]
            out = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=gqa)  # [B, heads, 1, hd]
            x = self._finish_layer(w, x, out.reshape(b, 1, -1), routes)
        self.last_routes = torch.stack(routes, dim=-2)[:, 0] if routes else None
        return self._logits(x[:, 0])

    def new_cache(self, slots: int, positions: int) -> torch.Tensor:
        s = self.spec
        return torch.zeros(s.num_layers, 2, slots, s.num_kv_heads, positions, s.head_dim)

    # ---- pieces --------------------------------------------------------------------------------
    def _embed(self, tokens, pos):
        if self.spec.positions == "learned":
            return self.top["wte"][tokens] + self.top["wpe"][pos]
        return self.top["wte"][tokens]

    def _norm(self, x, weight, bias=None):
        s = self.spec
        if s.norm == "layer":
            return F.layer_norm(x, (x.shape[-1],), weight, bias, s.norm_eps)
        return _rms_norm(x, weight, s.norm_eps)

    def _qkv(self, w, x, pos):
        s = self.spec
        n, t, _ = x.shape
        qkv = F.linear(self._norm(x, w["ln1_w"], w.get("ln1_b")), w["qkv_w"], w.get("qkv_b"))
        q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        v = qkv[..., q_dim + kv_dim:].view(n, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        qk = qkv[..., :q_dim + kv_dim].view(n, t, s.num_heads + s.num_kv_heads, s.head_dim)
        if s.qk_norm:  # per head, before RoPE
            qk = torch.cat([_rms_norm(qk[:, :, :s.num_heads], w["q_norm"], s.norm_eps),
                            _rms_norm(qk[:, :, s.num_heads:], w["k_norm"], s.norm_eps)], dim=2)
        if s.positions == "rope":  # on q and k at once; HF's rotate_half convention, the first rotary_dim dims
            cos, sin = self.cos[pos][:, :, None], self.sin[pos][:, :, None]  # [n, t, 1, rotary_dim/2]
            rd = s.rotary_dim
            x1, x2 = qk[..., :rd].chunk(2, dim=-1)
            rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
            qk = torch.cat(rotated if rd == s.head_dim else [*rotated, qk[..., rd:]], dim=-1)
        q = qk[:, :, :s.num_heads].transpose(1, 2)
        k = qk[:, :, s.num_heads:].transpose(1, 2)
        return q, k, v

    def _finish_layer(self, w, x, attn, routes: list[torch.Tensor]):
        n, t = x.shape[:2]
        if attn.dim() == 4:  # [n, heads, t, hd] -> [n, t, heads*hd]
            attn = attn.transpose(1, 2).reshape(n, t, -1)
        x = x + F.linear(attn, w["o_w"], w.get("o_b"))
        hdn = self._norm(x, w["ln2_w"], w.get("ln2_b"))
        if "experts" in w:
            out, chosen = self._moe(w, hdn.reshape(n * t, -1))
            routes.append(chosen.view(n, t, -1))
            return x + out.view(n, t, -1)
        if self.spec.gated:
            gate, up = F.linear(hdn, w["gate_up_w"]).chunk(2, dim=-1)
            return x + F.linear(F.silu(gate) * up, w["down_w"])
        return x + F.linear(F.gelu(F.linear(hdn, w["fc_w"], w["fc_b"]), approximate="tanh"), w["proj_w"], w["proj_b"])

    def _moe(self, w, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A MoE layer over tokens `h` [M, hidden]: (its output [M, hidden], each token's top-k expert ids
        [M, k] int32). The routed experts' outputs, weighted, are summed in ascending expert order (as
        transformers does), then the shared experts' output of the same input is added."""
        weights, chosen = _route(self.spec, w, h)
        out = torch.zeros_like(h)
        for e in torch.unique(chosen).tolist():
            token, slot = torch.where(chosen == e)
            gate_up, down = w["experts"][e]
            gate, up = F.linear(h[token], gate_up).chunk(2, dim=-1)
            out.index_add_(0, token, F.linear(F.silu(gate) * up, down) * weights[token, slot, None])
        if "shared" in w:
            gate_up, down = w["shared"]
            gate, up = F.linear(h, gate_up).chunk(2, dim=-1)
            out = out + F.linear(F.silu(gate) * up, down)
        return out, chosen.to(torch.int32)

    def _logits(self, h):
        return F.linear(self._norm(h, self.top["lnf_w"], self.top.get("lnf_b")), self.top["lm_head"])


def _route(spec: ModelSpec, w: dict, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of a MoE layer: (the chosen experts' weights [M, k], their ids [M, k], best first).
    softmax (qwen3_moe): the top-k of the softmax, renormalised with norm_topk_prob. sigmoid (glm4_moe):
    experts are chosen on sigmoid(logits) + the expert-score correction bias, within the best
    `router_group_topk` groups (a group's score: the sum of its best 2) when grouped; their weights are
    the sigmoid scores without the bias, renormalised with norm_topk_prob, times routed_scaling_factor."""
    logits = F.linear(h, w["router_w"])
    k = spec.moe_topk
    if spec.router_score == "softmax":
        weights, chosen = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        if spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        scores = logits.sigmoid()
        choice = scores + w["router_bias"] if "router_bias" in w else scores
        if spec.router_groups > 1:
            groups = choice.view(-1, spec.router_groups, spec.num_experts // spec.router_groups)
            best = torch.topk(groups.topk(2, dim=-1)[0].sum(dim=-1), spec.router_group_topk, dim=-1)[1]
            keep = torch.zeros(groups.shape[:2], dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep[:, :, None].expand_as(groups).reshape(choice.shape), float("-inf"))
        chosen = torch.topk(choice, k, dim=-1)[1]
        weights = scores.gather(1, chosen)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, chosen


def _rms_norm(x, w, eps):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _causal_attention(q, k, v, groups):
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)` (along dim 0), without the copy when the parts already lie one after another in
    one storage (received into `fused_layout` buffers): then the result is a view of that storage."""
    first = parts[0]
    offset, rows, row = first.storage_offset(), 0, math.prod(first.shape[1:])
    ptr = first.untyped_storage().data_ptr()
    for p in parts:
        if (not p.is_contiguous() or p.dtype != first.dtype or p.shape[1:] != first.shape[1:]
                or p.untyped_storage().data_ptr() != ptr or p.storage_offset() != offset + rows * row):
            return torch.cat(parts)
        rows += p.shape[0]
    return torch.empty(0, dtype=first.dtype).set_(first.untyped_storage(), offset, (rows, *first.shape[1:]))


# The HF tensors the model concatenates (by name suffix), in the order `_llama_weights` concatenates them:
# q/k/v weights and biases; gate/up of every gated MLP (dense, each routed expert, the shared experts).
_FUSED = ((".q_proj.weight", ".k_proj.weight", ".v_proj.weight"), (".q_proj.bias", ".k_proj.bias", ".v_proj.bias"),
          (".gate_proj.weight", ".up_proj.weight"))


def fused_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Empty tensors of the names, shapes and dtypes of `tensors`, where each group that the model
    concatenates (`_FUSED`) is consecutive row ranges of one buffer: a model built from them
    concatenates by viewing (`_cat_rows`), so weights received into them are served without another copy."""
    out: dict[str, torch.Tensor] = {}
    for name in tensors:
        for group in _FUSED:
            if name.endswith(group[0]):
                names = [name[:-len(group[0])] + g for g in group]
                parts = [tensors.get(n) for n in names]
                if all(p is not None and p.dtype == parts[0].dtype and p.shape[1:] == parts[0].shape[1:]
                       for p in parts):
                    buf = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype)
                    for n, piece in zip(names, buf.split([p.shape[0] for p in parts])):
                        out[n] = piece
    for name, t in tensors.items():
        if name not in out:
            out[name] = torch.empty(t.shape, dtype=t.dtype)
    return out


def _strip(name: str) -> str:
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def _stripped(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {_strip(k): v for k, v in tensors.items()}


def _hf_names(spec: ModelSpec) -> dict[str, tuple[str, ...]]:
    """Megatron name -> the (prefix-stripped) HF tensors it is made of: the family's tensor map, the one
    list of a family's names (miles_core.models.families)."""
    return {e.mcore: tuple(_strip(n) for n in e.hf) for e in ADAPTERS[spec.family].tensors(spec)}


def _check_shapes(spec: ModelSpec, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Every weight has the shape config.json implies. A snapshot with other shapes would load and then
    fail mid-generation with an opaque broadcast error; it is refused at load, naming the tensor."""
    t = _stripped(tensors)
    for name, want in _expected_shapes(spec).items():
        got = tuple(t[name].shape) if name in t else want  # a missing tensor is named when the weights are built
        if got != want:
            raise ModelLoadError(f"{source}: tensor {name!r} has shape {list(got)}, but config.json implies "
                                 f"{list(want)}; the weights do not match their config.")


def _expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The shape of every (prefix-stripped) HF tensor the family's map lists, from the spec."""
    return {name: _hf_shape(spec, name) for names in _hf_names(spec).values() for name in names}


def _hf_shape(spec: ModelSpec, name: str) -> tuple[int, ...]:
    h, v, hd = spec.hidden_size, spec.vocab_size, spec.head_dim
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    if ".experts." in name:
        f = spec.moe_ffn_hidden_size
    elif ".shared_experts." in name:
        f = spec.shared_expert_ffn_hidden_size
    else:
        f = spec.ffn_hidden_size
    by_suffix = {  # GPT-2's Conv1D weights are [in, out]
        "wte.weight": (v, h), "embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
        "wpe.weight": (spec.max_positions, h),
        "attn.c_attn.weight": (h, 3 * h), "attn.c_attn.bias": (3 * h,), "attn.c_proj.weight": (h, h),
        "mlp.c_fc.weight": (h, f), "mlp.c_fc.bias": (f,), "mlp.c_proj.weight": (f, h),
        "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "o_proj.weight": (h, q),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,), "q_norm.weight": (hd,), "k_norm.weight": (hd,),
        "gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f),
        "mlp.gate.weight": (spec.num_experts, h), "e_score_correction_bias": (spec.num_experts,),
    }
    for suffix, shape in by_suffix.items():
        if name == suffix or name.endswith("." + suffix):
            return shape
    return (h,)  # the norms' weights and biases, GPT-2's projection biases


def _gpt2_weights(spec: ModelSpec, tensors):
    t = _stripped(tensors)
    layers = []
    for i in range(spec.num_layers):
        p = f"h.{i}."
        layers.append({
            "ln1_w": t[p + "ln_1.weight"], "ln1_b": t[p + "ln_1.bias"],
            "qkv_w": t[p + "attn.c_attn.weight"].t().contiguous(), "qkv_b": t[p + "attn.c_attn.bias"],
            "o_w": t[p + "attn.c_proj.weight"].t().contiguous(), "o_b": t[p + "attn.c_proj.bias"],
            "ln2_w": t[p + "ln_2.weight"], "ln2_b": t[p + "ln_2.bias"],
            "fc_w": t[p + "mlp.c_fc.weight"].t().contiguous(), "fc_b": t[p + "mlp.c_fc.bias"],
            "proj_w": t[p + "mlp.c_proj.weight"].t().contiguous(), "proj_b": t[p + "mlp.c_proj.bias"],
        })
    lm_head = t["wte.weight"] if spec.tied_embeddings or "lm_head.weight" not in t else t["lm_head.weight"]
    top = {"wte": t["wte.weight"], "wpe": t["wpe.weight"], "lnf_w": t["ln_f.weight"], "lnf_b": t["ln_f.bias"],
           "lm_head": lm_head}
    return layers, top


def _llama_weights(spec: ModelSpec, tensors):
    """The llama-like families' weights, looked up by the Megatron role of each tensor in the family's
    map (`_hf_names`): q/k/v and gate/up concatenated (`_cat_rows`: a view when they lie in one buffer)."""
    t = _stripped(tensors)
    names = _hf_names(spec)

    def get(mcore: str) -> torch.Tensor:
        parts = [t[n] for n in names[mcore]]
        return parts[0] if len(parts) == 1 else _cat_rows(parts)

    def mlp(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        return get(prefix + "linear_fc1.weight"), get(prefix + "linear_fc2.weight")

    layers = []
    for i in range(spec.num_layers):
        d, a, m = f"decoder.layers.{i}.", f"decoder.layers.{i}.self_attention.", f"decoder.layers.{i}.mlp."
        w = {"ln1_w": get(d + "input_layernorm.weight"), "ln2_w": get(d + "pre_mlp_layernorm.weight"),
             "qkv_w": get(a + "linear_qkv.weight"), "o_w": get(a + "linear_proj.weight")}
        if a + "linear_qkv.bias" in names:
            w["qkv_b"] = get(a + "linear_qkv.bias")
        if spec.qk_norm:
            w["q_norm"], w["k_norm"] = get(a + "q_layernorm.weight"), get(a + "k_layernorm.weight")
        if spec.is_moe_layer(i):
            w["router_w"] = get(m + "router.weight")
            if m + "router.expert_bias" in names:
                w["router_bias"] = get(m + "router.expert_bias")
            w["experts"] = [mlp(f"{m}experts.local_experts.{e}.") for e in range(spec.num_experts)]
            if m + "shared_experts.linear_fc1.weight" in names:
                w["shared"] = mlp(m + "shared_experts.")
        else:
            w["gate_up_w"], w["down_w"] = mlp(m)
        layers.append(w)
    lm_head = t["lm_head.weight"] if "lm_head.weight" in t else t["embed_tokens.weight"]
    top = {"wte": get("embedding.word_embeddings.weight"), "lnf_w": get("decoder.final_layernorm.weight"),
           "lm_head": lm_head}
    return layers, top
