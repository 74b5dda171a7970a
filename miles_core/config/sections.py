"""The config tree: one frozen dataclass per component, each field one CLI flag.

Field names are unique across sections; the flag is the field name in kebab case
(`rollout_batch_size` -> `--rollout-batch-size`). `metadata["help"]` becomes `--help` and the
generated flag reference (docs/reference/flags.md); `metadata["choices"]` lists the allowed values.
Defaults are miles' (the flags a miles user knows mean the same here); the flags miles requires
(--hf-checkpoint, --prompt-data, --rollout-batch-size, --num-rollout) are required here too, and a
preset (`--preset tiny-reverse4`, the embedded default of `./dev run`) sets them
(docs/configuration.md#defaults-and-presets). The rules live in `miles_core.config.rules`: a rule
about one section takes that section, a rule across sections the whole config; components likewise
receive the section they read (docs/architecture.md#who-owns-what).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from miles_core.config.presets import PRESETS


def opt(default, help: str, choices: tuple[str, ...] | None = None, **kw):
    meta = {"help": help}
    if choices:
        meta["choices"] = choices
    return field(default=default, metadata=meta, **kw)


def opt_list(help: str, default: tuple[str, ...] = ()):
    return field(default_factory=lambda: list(default), metadata={"help": help})


@dataclass(frozen=True)
class RunSection:
    run_id: str = opt("default", "Run id: the run root is {storage_root}/runs/{run_id}/.")
    storage_root: str = opt(".miles", "Object-storage prefix for runs (file://, s3://, gs://, memory://, or a local path).")
    custom_config_path: str = opt("", "miles' YAML of settings (e.g. its mis.yaml): each key, a flag's name with underscores, sets that flag over the command line, as in miles; a key that is not a flag here is refused by name. The run's config.json records the values it set.")
    num_rollout: Optional[int] = opt(None, "Number of training steps (rollouts) of the run, counted from step 0 across segments. Required (a preset sets it).")
    segment_steps: Optional[int] = opt(None, "Run at most this many steps in this segment, then checkpoint and exit (scheduled continuation).")
    deadline_seconds: Optional[float] = opt(None, "Stop this segment cleanly after this many seconds (checkpoint first).")
    seed: int = opt(1234, "Global seed (model init, data shuffling, sampling).")
    preset: Optional[str] = opt(None, "Start from a named flag set (flags given explicitly override it): tiny-reverse4 = the embedded default, a 2-layer random model learning to reverse 4 digits on CPU in about two minutes (docs/quickstart.md); smollm2-arith = SmolLM2-135M-Instruct learning 2-digit addition on CPU (docs/real-model.md); smollm2-calculator = the same model learning to use a calculator tool in multi-turn episodes (docs/agentic.md). `miles validate --preset NAME` prints what it sets.", choices=tuple(PRESETS))
    fully_async: bool = opt(False, "Fully asynchronous driver: a continuous producer and a trainer draining the durable buffer (off: the synchronous driver, generate a batch then train on it; see --one-step-off).")
    one_step_off: bool = opt(False, "One-step-off driver: generate batch k+1 while training on batch k.")
    colocate: bool = opt(False, "Not supported (refused): place engines and trainer on the same devices (time-shared).")
    partial_rollout: bool = opt(False, "Not supported (refused): keep partially generated samples across weight updates by aborting and resuming them.")
    rollout_function_path: str = opt("", "Not supported (refused): module:function replacing the whole rollout loop.")
    rollout_all_samples_process_path: str = opt("", "Not supported (refused): module:function called with every generated sample, kept or not.")
    prefill_logprob_recompute: bool = opt(False, "Not supported (refused): recompute rollout log-probs with a prefill pass on the engines.")
    multi_lora: bool = opt(False, "Not supported (refused): serve several LoRA adapters on the engines.")
    progress: bool = opt(True, "Show a progress bar (step, reward, staleness, tokens/s) on local runs.")
    num_cpus_per_engine: float = opt(1.0, "Ray CPUs reserved by each engine actor.")
    num_cpus_trainer: float = opt(1.0, "Ray CPUs reserved by each trainer rank actor, and its torch threads. Default 1; 4 on a run with GPUs (--engine-backend sglang) when not given: the train task's GPU pods have 8 CPUs per GPU, and rank 0's export of the weights runs on these threads.")
    lease_ttl_seconds: float = opt(60.0, "One writer per run root: the write lease expires this long after its holder's last renewal (a crashed writer's run is taken over then); the holder stops writing at 3/4 of it without a renewal.")
    lease_renew_seconds: Optional[float] = opt(None, "How often the lease holder renews its lease; default --lease-ttl-seconds / 4, at most a third of it.")

    @property
    def total_steps(self) -> int:
        """--num-rollout of a checked config (the check refuses a config without it)."""
        if self.num_rollout is None:
            raise ValueError("--num-rollout is required (a preset sets it)")
        return self.num_rollout

    @property
    def rank_threads(self) -> int:
        """A trainer rank's torch threads: the CPUs Ray reserved for it (--num-cpus-trainer), at least one
        (Ray sets OMP_NUM_THREADS to a 1-CPU actor's reservation, which torch would otherwise follow)."""
        return max(1, int(self.num_cpus_trainer))


@dataclass(frozen=True)
class ModelSection:
    hf_checkpoint: str = opt("", "Required (a preset sets it). HF checkpoint directory/URI of a supported family (llama incl. Llama 3.x RoPE scaling, qwen2, qwen3, qwen3_moe, glm4_moe: docs/models.md); a .gguf file or import:smollm2-135m-instruct (imported once); or a builtin tiny model, random init from --seed: builtin:tiny-gpt / builtin:tiny-llama / builtin:tiny-llama3 / builtin:tiny-qwen2 / builtin:tiny-qwen3 / builtin:tiny-qwen3-moe / builtin:tiny-glm4-moe.")
    tiny_num_layers: int = opt(2, "Layers of a builtin tiny model.")
    tiny_hidden_size: int = opt(128, "Hidden size of a builtin tiny model.")
    tiny_num_heads: int = opt(4, "Attention heads of a builtin tiny model.")


@dataclass(frozen=True)
class DataSection:
    prompt_data: str = opt("", "Required (a preset sets it). Prompt dataset: JSONL/Parquet/Arrow URI, or builtin:reverse4 (reverse 4 digits), builtin:copy4 (copy them), builtin:arith (2-digit addition, text prompts), builtin:calc3 (3-digit sums with a calculator tool, chat messages: docs/agentic.md) or builtin:sum3 (the same sums without the tool).")
    input_key: str = opt("input", "Dataset column holding the prompt (text, or a list of token ids). The builtin datasets read their own columns.")
    label_key: str = opt("", "Dataset column holding the label the reward compares against ('': none, the reward gets an empty label). The builtin datasets read their own columns.")
    rollout_shuffle: bool = opt(False, "Shuffle prompts every epoch (seeded).")
    apply_chat_template: bool = opt(False, "Render each prompt with the tokenizer's chat template, generation prompt appended: a string prompt becomes one user message, a list of {role, content} messages is used as it is.")
    max_seq_len: Optional[int] = opt(None, "Longest prompt + response in tokens: prompts that leave no room for one response token are dropped at preparation (counted in the dataset's metadata and logged), and each response is capped at this minus its prompt length.")


@dataclass(frozen=True)
class RolloutSection:
    rollout_batch_size: Optional[int] = opt(None, "Prompt groups consumed per training step. Required (a preset sets it).")
    n_samples_per_prompt: int = opt(1, "Samples per prompt group.")
    rollout_max_response_len: Optional[int] = opt(None, "Maximum new tokens per sample (none: up to the model's context, as SGLang does without max_new_tokens; --max-seq-len caps it).")
    rollout_temperature: float = opt(1.0, "Sampling temperature.")
    rollout_top_p: float = opt(1.0, "Nucleus sampling p.")
    rollout_top_k: int = opt(-1, "Top-k sampling (-1: off).")
    async_max_concurrent_samples: Optional[int] = opt(None, "Samples in flight on the engines (budget in groups = this // n); default: rollout_batch_size groups.")
    rollout_submission_granularity: Optional[str] = opt(None, "When a new group may start: 'group' (fewer than budget groups pending) or 'sample' (credits of samples in flight). Default: sample under --fully-async, else group.", choices=("group", "sample"))
    max_weight_staleness: Optional[int] = opt(None, "Reject groups older than this many weight versions at consumption, and admit no group that could not be consumed in time.")
    update_weights_interval: int = opt(1, "Push weights to the engines every N training steps.")
    pause_generation_mode: str = opt("retract", "How engines pause for a weight update: retract (re-queue, recompute cache), in_place (keep cache), abort.", choices=("retract", "in_place", "abort"))
    custom_rm_path: str = opt("", "module:function reward; default: --rm-type's, else the built-in reward of the prompt dataset.")
    rm_type: str = opt("", "miles' rule-based reward of the response text against the label (docs/algorithms.md#reward-types): math (math-verify), deepscaler, dapo (+1/-1), f1, each also as boxed_NAME (the last \\boxed{} only); remote_rm = the reward model at --rm-url. --custom-rm-path wins when both are set, as in miles.")
    rm_url: str = opt("", "The reward model of --rm-type remote_rm: each sample POSTed as miles' {prompt, response, label}, the JSON number answered is its reward; timeouts, retries with backoff, MILES_RM_API_KEY as a bearer token (docs/algorithms.md#a-remote-reward-model).")
    custom_generate_function_path: str = opt("", "module:function replacing one engine call per sample (agentic multi-turn rollouts): async def fn(args, sample, sampling_params[, evaluation]) -> Sample | list[Sample]; args.engine is the load-balanced engine client. Also used by eval with evaluation=True. See docs/agentic.md.")
    dynamic_sampling_filter_path: str = opt("", "module:function(group) -> (keep, reason) applied at buffer put; dropped groups are counted by reason.")
    rollout_sample_filter_path: str = opt("", "module:function(groups) marking samples excluded from the loss (mark only, never drops).")
    engine_request_timeout_seconds: float = opt(600.0, "Timeout of one /generate request.")
    custom_generate_timeout_seconds: float = opt(3600.0, "An episode of --custom-generate-function-path that has not returned after this long fails its group, as a raising one does (a hung environment or tool never holds its submission credit for ever).")
    reward_timeout_seconds: float = opt(300.0, "A reward function call (per sample, or per group when batched) that has not returned after this long fails its samples, as a raising one does (a hung reward never stalls the run).")
    max_failed_sample_fraction: float = opt(0.5, "Fail the run when the reward function or the custom generate function fails (raises, times out, returns a non-number) on more than this share of the samples it was given over --failed-sample-window-steps steps; 1 never fails the run. A single failure only fails its sample.")
    failed_sample_window_steps: int = opt(5, "The window of training steps over which --max-failed-sample-fraction is judged (a segment shorter than the window is judged at its last step).")

    @property
    def groups_per_step(self) -> int:
        """--rollout-batch-size of a checked config (the check refuses a config without it)."""
        if self.rollout_batch_size is None:
            raise ValueError("--rollout-batch-size is required (a preset sets it)")
        return self.rollout_batch_size


@dataclass(frozen=True)
class BufferSection:
    async_data_buffer_capacity_factor: float = opt(2.0, "Buffer capacity = int(factor * rollout_batch_size) groups; put blocks when full.")
    async_unused_samples_handler: str = opt("drop", "What happens to rejected (aborted or stale) groups: drop (counted) or retry (prompt back to the data source).", choices=("drop", "retry"))
    custom_async_data_buffer_path: str = opt("", "module:Class replacing the durable buffer; built with (config, unused_samples_handler).")
    buffer_delete_consumed_objects: bool = opt(False, "At each checkpoint, delete the buffer objects whose groups were all consumed (or rejected) through it. Keeps listings and storage bounded by the backlog; loses the consumed groups' data (replay, lineage of their samples). The per-step consumption manifests stay.")
    allow_rollout_producers: bool = opt(False, "Let rollout producer jobs (workflows/rollout_producer.py, in this cluster or another) feed this run's buffer through the run root alone: prompts are claimed in blocks in the run root by every writer, the trainer lists the buffer for other writers' groups, and every weight version is published to the run root whatever --weight-transport. Needed for --rollout-num-engines 0. docs/elastic.md.")
    prompt_claim_block_size: Optional[int] = opt(None, "Prompts per claim block under --allow-rollout-producers (default: --rollout-batch-size, one step's worth). A killed writer's unfinished block is generated again by another writer after --prompt-claim-ttl-seconds.")
    prompt_claim_ttl_seconds: float = opt(60.0, "A prompt claim expires this long after its holder's last renewal (holders renew every third of it); then another writer claims the block's prompts that were not committed.")
    producer_poll_seconds: float = opt(1.0, "Under --allow-rollout-producers: how often the trainer lists the buffer for groups committed by other writers, and producers read the run's published weights and feed.")
    buffer_coalesce_seconds: float = opt(0.0, "Extra wait for more puts before committing an object. 0 = group commit: puts that arrive while the previous object is being written go into the next object together (measured best: bench/buffer.py).")


@dataclass(frozen=True)
class EngineSection:
    engine_backend: str = opt("cpu", "Generation engine: the project's CPU engine server, or SGLang (GPU).", choices=("cpu", "sglang"))
    rollout_num_engines: int = opt(1, "Number of rollout engine servers.")
    rollout_num_gpus_per_engine: int = opt(1, "GPUs per SGLang engine (its tensor parallel size).")
    engine_max_running_requests: int = opt(512, "Requests an engine batches at once (continuous batching).")
    sglang_mem_fraction_static: float = opt(0.8, "SGLang --mem-fraction-static.")
    sglang_extra_args: str = opt("", "Extra arguments appended to `python -m sglang.launch_server`.")
    weight_transport: str = opt("store", "How weights reach the engines: store (a snapshot in the run root that each engine copies to its own node and loads with update_weights_from_disk) or distributed (SGLang's /init_weights_update_group + /update_weights_from_distributed broadcast: NCCL on GPU, gloo on CPU).", choices=("store", "distributed"))
    weight_anchor_interval: int = opt(20, "Weight versions in the run root (the store transport's, and every version producer jobs read) are bf16: the first 3 and then at least every this many are anchors (the whole model), the others sparse deltas against the version before (the changed bf16 elements, compressed, checksummed). 1: every version an anchor. docs/weight-versions.md.")
    update_weight_buffer_size: int = opt(512 << 20, "Bytes per bucket of the distributed weight push (one /update_weights_from_distributed call and broadcast per bucket).")
    engine_custom_resource: str = opt("", "Ray custom resource every engine actor requests (a sliver of one unit): pins engines to the nodes that offer it, e.g. a GPU node group.")
    trainer_custom_resource: str = opt("", "Ray custom resource every trainer rank requests (a sliver of one unit): pins the trainer to the nodes that offer it.")
    engine_bind_host: str = opt("auto", "Address engine servers bind, and the host of the engine URLs every role calls. auto: 127.0.0.1 when the Ray cluster has one node, else the engine's node address as Ray sees it (a multi-node cluster then needs MILES_ENGINE_API_KEY). 0.0.0.0 binds every interface (URLs use the node address).")
    engine_startup_timeout_seconds: float = opt(900.0, "How long an engine (or its restart) may take to answer /health.")


@dataclass(frozen=True)
class TrainSection:
    lr: float = opt(1e-6, "Learning rate.")
    weight_decay: float = opt(0.01, "AdamW weight decay.")
    clip_grad: float = opt(1.0, "Gradient-norm clip.")
    bf16: bool = opt(False, "Train with bf16 weights and activations and fp32 main weights in Megatron's mixed-precision optimizer. A trainer on GPUs always trains in bf16; on a machine without GPUs it trains in fp32 unless this is set.")
    transformer_impl: str = opt("auto", "The trainer's transformer layers (Megatron's --transformer-impl): transformer_engine = Transformer Engine's fused layers (needs a GPU and the transformer_engine package), local = Megatron's plain torch layers; auto = transformer_engine where it imports on a GPU, else local. Checkpoints move between the two.", choices=("auto", "local", "transformer_engine"))
    use_distributed_optimizer: bool = opt(False, "Megatron's distributed optimizer (ZeRO-1): the fp32 main weights and Adam moments are sharded over data-parallel ranks, 12 bytes per parameter / DP instead of 12 on every rank. Checkpoints gather its state onto DP rank 0 (Megatron's dp-zero format), so they resume at any DP size.")
    advantage_estimator: str = opt("grpo", "How rewards become advantages (docs/algorithms.md): grpo (group-normalized), gspo (grpo's advantages, a sequence-level importance ratio and clip), reinforce_plus_plus (the reward as a return on the last token, --gamma; needs --normalize-advantages), reinforce_plus_plus_baseline (reward minus the group mean; needs --normalize-advantages); ppo (a critic) is not supported (refused).", choices=("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"))
    normalize_advantages: bool = opt(False, "Whiten the advantages over the rollout's loss tokens (minus their mean, divided by their unbiased std), as miles' --normalize-advantages; required by the reinforce_plus_plus estimators.")
    gamma: float = opt(1.0, "Discount of reinforce_plus_plus's per-token return (miles' --gamma); 1 = the reward on every token.")
    kl_coef: float = opt(0.0, "miles' KL penalty in the reward, before the advantages (reinforce_plus_plus estimators): each token's reward gets -kl_coef x its KL (--kl-loss-type) between the ratio's denominator policy and the initial model (docs/algorithms.md). The KL in the loss is --use-kl-loss.")
    normalize_advantages_std: bool = opt(True, "Divide GRPO advantages by the group reward std.")
    eps_clip: float = opt(0.2, "PPO clip epsilon (low side).")
    eps_clip_high: Optional[float] = opt(None, "PPO clip epsilon (high side); default: --eps-clip.")
    use_tis: bool = opt(False, "Truncated importance sampling against the rollout log-probs.")
    tis_clip: float = opt(2.0, "Upper clamp of the TIS weight.")
    tis_clip_low: float = opt(0.0, "Lower clamp of the TIS weight.")
    use_rollout_logprobs: bool = opt(False, "Use the engine's log-probs as the PPO ratio denominator (exclusive with --use-tis).")
    custom_tis_function_path: str = opt("", "miles' off-policy correction called by the policy loss with --use-tis (or --get-mismatch-metrics) in place of the built-in TIS: module:function or module.function with miles' contract (docs/algorithms.md#off-policy-corrections---custom-tis-function-path). Built in: miles_core.train.corrections.icepop_function, .vanilla_tis_function, .compute_mis_weights_with_cp (miles' MIS); miles' own paths of these are accepted.")
    get_mismatch_metrics: bool = opt(False, "Call --custom-tis-function-path for its metrics (train-rollout KL, perplexities, ...) without changing the loss (miles' flag).")
    tis_level: str = opt("token", "MIS (compute_mis_weights_with_cp): the IS ratio per token, per sequence (the product over its loss tokens) or geometric (their geometric mean). A key of miles' mis.yaml.", choices=("token", "sequence", "geometric"))
    tis_mode: str = opt("truncate", "MIS: what happens to an IS weight outside its bounds: truncate (capped at --tis-upper-bound), clip (clamped to both bounds) or mask (the token rejected).", choices=("truncate", "clip", "mask"))
    tis_lower_bound: Optional[float] = opt(None, "MIS: lower bound of the IS weight (clip and mask modes); default 1 / --tis-upper-bound.")
    tis_upper_bound: float = opt(2.0, "MIS: upper bound of the IS weight.")
    use_rs: bool = opt(False, "MIS: rejection sampling, tokens whose ratio at --rs-level lies outside [--rs-lower-bound, --rs-upper-bound] leave the loss.")
    rs_level: str = opt("token", "MIS: the level of the rejection ratio (as --tis-level).", choices=("token", "sequence", "geometric"))
    rs_lower_bound: Optional[float] = opt(None, "MIS: lower bound of rejection sampling; default the IS lower bound.")
    rs_upper_bound: Optional[float] = opt(None, "MIS: upper bound of rejection sampling; default --tis-upper-bound.")
    rs_veto_threshold: Optional[float] = opt(None, "MIS with --use-rs: a sequence holding a loss token whose own ratio is below this is rejected whole.")
    tis_batch_normalize: bool = opt(False, "MIS: divide the IS weights by their mean over the micro-batch (--tis-level token or sequence).")
    use_opsm: bool = opt(False, "Off-policy sequence masking (miles' OPSM): a sequence with a negative advantage whose mean log-ratio old/current over its loss tokens exceeds --opsm-delta is left out of the policy loss (docs/algorithms.md).")
    opsm_delta: float = opt(1e-4, "OPSM's threshold on a sequence's mean log(p_old / p) (miles' default).")
    use_decoupled_loss: bool = opt(False, "Decoupled PPO: proximal policy = trainer weights before the step, behaviour = rollout log-probs.")
    use_kl_loss: bool = opt(False, "KL penalty to the initial (reference) model.")
    kl_loss_type: str = opt("k1", "The KL estimator of --use-kl-loss, as miles names them (docs/algorithms.md): k1 = log(p/p_ref), k2 = log(p/p_ref)^2 / 2, k3 = p_ref/p - 1 - log(p_ref/p), low_var_kl = k3 with its log-ratio clamped to [-20, 20] and the value to [-10, 10].", choices=("k1", "k2", "k3", "low_var_kl"))
    kl_loss_coef: float = opt(0.0, "Coefficient of the KL penalty (0 with --use-kl-loss: train/kl_loss is measured against the reference, as miles does, without entering the loss).")
    entropy_coef: float = opt(0.0, "Entropy bonus coefficient.")
    actor_num_nodes: int = opt(1, "Nodes of the trainer (miles' name); ranks = --actor-num-nodes x --actor-num-gpus-per-node.")
    actor_num_gpus_per_node: int = opt(8, "Trainer ranks per node: one GPU each, or one CPU rank process each on a machine without GPUs.")
    tensor_model_parallel_size: int = opt(1, "Megatron tensor parallel size; data parallel size = ranks / this.")
    pipeline_model_parallel_size: int = opt(1, "Megatron pipeline parallel size (only 1 is supported).")
    context_parallel_size: int = opt(1, "Megatron context parallel size (only 1 is supported).")
    expert_model_parallel_size: int = opt(1, "Megatron expert parallel size (mixture-of-experts models): each rank of an expert-parallel group holds num_experts / this of every MoE layer's routed experts, and tokens travel to their experts by all-to-all. Must divide the model's experts and, times --expert-tensor-parallel-size, the trainer's ranks; the dense layers stay data-parallel over all of them. docs/training.md#expert-parallelism.")
    expert_tensor_parallel_size: Optional[int] = opt(None, "Megatron tensor parallel size of the routed experts; default (and the only one supported): --tensor-model-parallel-size, each expert split like the dense MLPs. 1 with --tensor-model-parallel-size 1 is that default.")
    num_experts: Optional[int] = opt(None, "miles' model flag: routed experts per MoE layer. Read from the checkpoint's config.json; when given it must equal it (a run is refused naming both).")
    moe_router_topk: Optional[int] = opt(None, "miles' model flag: experts each token is routed to (config.json's num_experts_per_tok); when given it must equal the checkpoint's.")
    moe_ffn_hidden_size: Optional[int] = opt(None, "miles' model flag: a routed expert's MLP width (config.json's moe_intermediate_size); when given it must equal the checkpoint's.")
    moe_shared_expert_intermediate_size: Optional[int] = opt(None, "miles' model flag: the shared experts' total MLP width (GLM: n_shared_experts x moe_intermediate_size); when given it must equal the checkpoint's (a model without shared experts has none: do not pass it).")
    moe_router_score_function: Optional[str] = opt(None, "miles' model flag: the router's score function (Qwen3-MoE softmax, GLM-4.5 sigmoid); when given it must be the checkpoint family's.", choices=("softmax", "sigmoid"))
    moe_router_enable_expert_bias: bool = opt(False, "miles' model flag: the router's expert-score correction bias (GLM's e_score_correction_bias). Whether the model has one is read from the checkpoint; when set, the checkpoint must have one.")
    moe_router_topk_scaling_factor: Optional[float] = opt(None, "miles' model flag: the factor the chosen experts' weights are scaled by (GLM's routed_scaling_factor); when given it must equal the checkpoint's (1.0 for a model without one).")
    moe_router_pre_softmax: bool = opt(False, "miles' model flag: a softmax router's softmax over every expert before the top-k (the chosen weights are then not renormalised). Read from the checkpoint (config.json's norm_topk_prob false); when set, a softmax router's checkpoint must have norm_topk_prob false. A sigmoid router has no such choice (Megatron reads the flag only for softmax), so it is accepted there, as miles' GLM recipes pass it.")
    moe_router_num_groups: Optional[int] = opt(None, "miles' model flag: expert groups of grouped top-k routing (GLM's n_group); when given it must equal the checkpoint's.")
    moe_router_group_topk: Optional[int] = opt(None, "miles' model flag: the groups each token may choose experts from (GLM's topk_group); when given it must equal the checkpoint's.")
    moe_layer_freq: str = opt("", "miles' model flag: which layers are MoE layers, as Megatron reads it: an integer N (every N-th layer, from layer 0) or a per-layer pattern such as [0]*1+[1]*45; when given it must describe the checkpoint's layers (GLM: first_k_dense_replace dense layers first). Empty: the checkpoint's.")
    moe_aux_loss_coeff: Optional[float] = opt(None, "Megatron's load-balancing aux loss coefficient (miles' meaning: per MoE layer, summed over them). Default: the checkpoint's router_aux_loss_coef x top-k / MoE layers, which makes the loss term transformers' aux loss (0 for a model without one); 0 turns the aux loss off.")
    moe_router_load_balancing_type: str = opt("aux_loss", "The load-balancing loss: aux_loss (transformers' load_balancing_loss_func, what the trainer computes, weighted by --moe-aux-loss-coeff; nothing where that is 0) or none (no aux loss, whatever --moe-aux-loss-coeff). seq_aux_loss, global_aux_loss and sinkhorn are accepted only where no aux loss is computed (coefficient 0, as miles' GLM recipes pass them), else refused as not supported.", choices=("aux_loss", "none", "seq_aux_loss", "global_aux_loss", "sinkhorn"))
    moe_token_dispatcher_type: str = opt("alltoall", "How tokens reach their experts: Megatron's alltoall dispatcher (all-to-all over the expert-parallel group; gloo on CPU, NCCL on GPU). allgather and flex (DeepEP) are not supported.", choices=("alltoall", "allgather", "flex"))
    moe_router_dtype: Optional[str] = opt(None, "The router's precision: it always runs in fp32 (routing in bf16 flips near-ties between experts; GLM's own router is fp32), so fp32 is what it means here and fp64 is not supported.", choices=("fp32", "fp64"))
    moe_router_bias_update_rate: float = opt(0.0, "miles' rate of the aux-loss-free expert-bias update. Only 0 (miles' GLM recipes): the expert bias is a checkpoint weight (GLM's e_score_correction_bias), kept as loaded and exported back.")
    use_rollout_routing_replay: bool = opt(False, "miles' rollout routing replay (R3), for a mixture-of-experts model: the engines return each token's routed experts, the samples keep them, and the trainer routes every token to the experts the engine routed it to (its router still scores them, so it still learns); train/routing_mismatch and train/routing_mismatch_own show the effect. Refused for a dense model and with --recompute-granularity=full. docs/training.md#rollout-routing-replay.")
    sequence_parallel: bool = opt(False, "Megatron sequence parallelism: outside the tensor-parallel matmuls (norms, residuals, dropout) each tensor-parallel rank keeps only its 1/TP slice of the sequence, so those activations shrink by the TP size. Needs --tensor-model-parallel-size > 1; a micro-batch is padded to a multiple of it (the padding is out of the loss).")
    recompute_granularity: Optional[str] = opt(None, "Activation recomputation (Megatron's): full = keep only each recomputed layer's input and run the layer again in backward (needs --recompute-method and --recompute-num-layers); selective = recompute the core attention (the s x s scores and probabilities) of every layer. Default: keep every activation.", choices=("full", "selective"))
    recompute_method: Optional[str] = opt(None, "Which layers --recompute-granularity=full recomputes: uniform = every layer, in chunks of --recompute-num-layers layers (one saved input per chunk); block = the first --recompute-num-layers layers, the rest keep their activations.", choices=("uniform", "block"))
    recompute_num_layers: Optional[int] = opt(None, "With --recompute-granularity=full: layers per recomputed chunk (uniform; must divide the model's layers) or layers recomputed (block; at most the model's layers).")
    balance_data: bool = opt(False, "Split each batch across data-parallel ranks by token count (longest first onto the lightest rank) instead of by sample count.")
    distributed_timeout_minutes: int = opt(10, "Megatron's --distributed-timeout-minutes: how long a collective of the trainer's process groups may wait before it fails. On GPU NCCL's watchdog then tears the rank's process down (10 minutes is NCCL's and Megatron's default); a retry resumes from the last checkpoint. Checkpoint saves do not wait in these groups (a rank waits for the upload of another in a CPU group with no such limit), so a long upload cannot trip it.")
    micro_batch_size: int = opt(1, "Samples per forward/backward micro-batch (each right-padded to its longest sample); not used with --use-dynamic-batch-size.")
    use_dynamic_batch_size: bool = opt(False, "miles' dynamic batch size: micro-batches are packed by tokens instead of cut by --micro-batch-size. Each DP rank groups its samples (longest first, first fit) into micro-batches of at most --max-tokens-per-gpu tokens and runs each as one row of the samples back to back, without padding (each sample attends only to itself). The update is the same as with padded micro-batches. Needs --max-tokens-per-gpu.")
    max_tokens_per_gpu: Optional[int] = opt(None, "Token budget of one micro-batch per GPU with --use-dynamic-batch-size (prompt + response tokens of the samples packed together). A sample longer than this gets a micro-batch of its own. Required by, and only valid with, --use-dynamic-batch-size.")
    gpu_memory_gb: Optional[float] = opt(None, "Memory of one trainer GPU in GiB, compared with the trainer's estimated memory per GPU (weights, gradients, optimizer, activations and logits of one micro-batch) before the run starts: refused when even 0.75x the estimate exceeds it (the estimate is an upper bound), a warning when only the estimate does. Default: each trainer rank's CUDA device's memory, compared the same way before its model is built (nothing on CPU).")
    global_batch_size: Optional[int] = opt(None, "Samples per optimizer step (miles' meaning): a rollout of rollout_batch_size x n_samples_per_prompt samples gives that / this optimizer steps, which must divide evenly. Default: one optimizer step per rollout.")
    load: str = opt("", "Checkpoint location to start from (miles' --load). Empty or equal to --save: resume this run from its latest checkpoint. Another location: when this run has no checkpoint yet, its weights and optimizer state come from the latest checkpoint there (the step, data cursor and buffer belong to a run root and start fresh).")
    ref_load: str = opt("", "Reference weights (miles' --ref-load): an HF directory/URI or a checkpoint location (a --save of an earlier run). The KL reference of --use-kl-loss, and the trainer's initial weights when there is no checkpoint to load. Default: --hf-checkpoint.")
    save: str = opt("auto", "Checkpoint location: 'auto' = {run root}/checkpoints, a URI, or '' to disable.")
    save_interval: Optional[int] = opt(None, "Save a checkpoint every N steps (and always at the last step; none: only at the last step of each segment).")
    save_hf: str = opt("", "Also save an HF checkpoint at each save into this directory ({step} placeholder allowed); enables eval reuse mode.")
    verify_checkpoint_checksums: bool = opt(False, "On resume, verify every file's sha256 against the checkpoint's COMPLETE manifest (reads the whole checkpoint on every rank). Sizes are always verified, and checksums too when the checkpoint is under 256 MiB; a checkpoint that does not verify is skipped for the newest older one that does, with a warning.")


@dataclass(frozen=True)
class EvalSection:
    eval_prompt_data: list[str] = opt_list("Eval datasets as name=uri pairs (builtin: datasets allowed, e.g. builtin:reverse4-heldout, builtin:arith-heldout); none (or no value) to disable evals. Default: follows --prompt-data: a builtin task's held-out split (builtin:reverse4 -> heldout=builtin:reverse4-heldout, builtin:arith -> heldout=builtin:arith-heldout), none for any other data.",
                                           default=())
    n_samples_per_eval_prompt: int = opt(1, "Samples per eval prompt (pass@k for k up to this).")
    eval_max_response_len: Optional[int] = opt(None, "Maximum new tokens in eval; default: --rollout-max-response-len.")
    eval_temperature: Optional[float] = opt(None, "Eval sampling temperature (0 = greedy); default: --rollout-temperature.")
    eval_interval: Optional[int] = opt(None, "Evaluate every N steps (and always at the last step). Not given: 40 when the run has eval datasets, none when it has none (--eval-prompt-data none, or data without a default eval set).")
    eval_mode: str = opt("tasks", "Where evals run: tasks (separate Flyte eval tasks on snapshots), shared (the rollout engines), dedicated (--eval-num-gpus engines).", choices=("tasks", "shared", "dedicated"))
    eval_hf_dir: str = opt("", "Where exported snapshots go; default: {run root}/snapshots.")
    eval_keep_snapshots: int = opt(2, "Exported snapshots kept beyond those still pending (ring retirement).")
    eval_max_in_flight: int = opt(2, "Pending evals at most.")
    eval_overflow_policy: str = opt("backpressure", "When --eval-max-in-flight evals are pending: backpressure (wait) or skip (metric eval/skipped_busy).", choices=("backpressure", "skip"))
    eval_num_gpus: int = opt(0, "Dedicated eval engines (Mode 2); 0 = none.")
    eval_max_prompts: Optional[int] = opt(None, "Evaluate only the first N prompts of each eval dataset (default: all).")
    eval_pass_threshold: float = opt(1.0, "A sample counts as solved for pass@k when its reward is >= this.")
    eval_backpressure_timeout_seconds: float = opt(1800.0, "Longest wait for a free eval slot under --eval-overflow-policy=backpressure; then the step is skipped (eval/skipped_busy).")


@dataclass(frozen=True)
class MetricsSection:
    use_tensorboard: bool = opt(False, "Mirror every metric event of the run (all components) to TensorBoard event files (the `tensorboard` extra). The run root's metrics/ stay the source of truth.")
    tensorboard_dir: str = opt("", "Where the TensorBoard event files go: a local directory, or '' = {run root}/tensorboard (written in place on a file:// run root, else written on the driver's node and copied there as they grow).")
    use_wandb: bool = opt(False, "Mirror every metric event of the run to Weights & Biases (the `wandb` extra). The API key comes only from WANDB_API_KEY (or the Flyte secret named by MILES_WANDB_API_KEY_SECRET), never from a flag.")
    wandb_project: str = opt("", "W&B project of the run ('': W&B's own default, $WANDB_PROJECT or uncategorized).")
    wandb_group: str = opt("", "W&B group of the run (default: none).")
    wandb_mode: Optional[str] = opt(None, "W&B mode: online (needs the API key), offline (files under --wandb-dir, `wandb sync` later), disabled; default: W&B's own ($WANDB_MODE, else online).", choices=("online", "offline", "disabled"))
    wandb_dir: str = opt("", "Local directory of W&B's files (default: W&B's own, $WANDB_DIR or ./wandb).")
    metrics_mirror_interval_seconds: float = opt(10.0, "How often the driver forwards new metric events from the run root to TensorBoard / W&B.")
    trace: bool = opt(True, "Record the run's timeline (engine requests, each group's life, trainer step phases, weight pushes, checkpoints, evals) under {run root}/trace/; `miles trace RUN_URI` writes it as Chrome trace-event JSON that Perfetto opens, and the report draws the last steps. --no-trace records nothing.")
    trace_sample_groups: float = opt(0.25, "Fraction of groups whose life and engine requests the trace records (the same groups in every process, chosen by group id); trainer, push, checkpoint and eval spans are always recorded. 1 records every group (about 90 KB per step of the embedded default instead of about 25 KB).")
    trace_window_steps: int = opt(1000, "The trace keeps the spans of the last this many steps: the driver deletes older trace chunks every 100 steps. 0 keeps everything.")
    trace_flush_seconds: float = opt(10.0, "How often each process writes its buffered trace events to the run root (one object per process per interval).")
    prometheus_port: Optional[int] = opt(None, "Serve the run's live metrics for Prometheus on this port of the driver's host (/metrics, text format): every step's metrics as gauges named miles_<metric> (queue size, staleness, tokens/s, in-flight groups, step seconds, engines), plus counters miles_steps_total, miles_weight_pushes_total, miles_groups_aborted_total and miles_groups_recycled_total. 0 picks a free port (logged). Default: not served.")


# The eval datasets a run gets when --eval-prompt-data is not given: the held-out split of the builtin
# task it trains on, nothing for any other --prompt-data (a builtin eval set scored by the user's own
# reward means nothing). EvalSection's declared default is the entry of DataSection's default.
DEFAULT_EVAL_PROMPT_DATA: dict[str, tuple[str, ...]] = {
    "builtin:reverse4": ("heldout=builtin:reverse4-heldout",),
    "builtin:arith": ("heldout=builtin:arith-heldout",),
    "builtin:calc3": ("heldout=builtin:calc3-heldout",),
    "builtin:sum3": ("heldout=builtin:sum3-heldout",),
}


def default_eval_prompt_data(prompt_data: str) -> list[str]:
    """The eval datasets that follow `prompt_data` when --eval-prompt-data is not given."""
    return list(DEFAULT_EVAL_PROMPT_DATA.get(prompt_data, ()))


def default_eval_interval(eval_prompt_data: list[str]):
    """--eval-interval when not given: EvalSection's default with eval datasets, none without."""
    return EVAL_INTERVAL_WITH_DATA if eval_prompt_data else None


EVAL_INTERVAL_WITH_DATA = 40  # --eval-interval of a run with eval datasets that does not give one


SECTIONS = {
    "run": RunSection,
    "model": ModelSection,
    "data": DataSection,
    "rollout": RolloutSection,
    "buffer": BufferSection,
    "engine": EngineSection,
    "train": TrainSection,
    "eval": EvalSection,
    "metrics": MetricsSection,
}
