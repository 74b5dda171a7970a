"""The config's own rules: every rule that needs nothing but the config's values.

    check(cfg)              # one ConfigError listing every problem, each naming its flags
    type_problems(cfg)      # wrong value types (the other rules compare values)
    rule_problems(cfg)      # ranges, exclusions, names, schemes, local inputs

Rules that load a plug-in or read a model spec run above the config, where those live
(`miles_core.prepare.checks.validate`, which also runs these). Nothing here rewrites the config.
"""

from __future__ import annotations

import importlib.util
import math
import os

import fsspec

from miles_core.config.miles_flags import REMOTE_RM, RM_TYPES, rm_type_supported
from miles_core.config.sections import MetricsSection, TrainSection
from miles_core.config.tree import ConfigError, RunConfig, flag_table
from miles_core.storage import InvalidName, validate_name
from miles_core.storage.lease import check_timings

# Features the fully async driver cannot honour, with the flag that turns each on (docs/configuration.md).
# The sync drivers of this project do not implement them either: under every driver they are
# refused with "not supported" (docs/real-model.md), never accepted and ignored.
FULLY_ASYNC_EXCLUDES = {
    "colocate": "--colocate",
    "partial_rollout": "--partial-rollout",
    "prefill_logprob_recompute": "--prefill-logprob-recompute",
    "rollout_all_samples_process_path": "--rollout-all-samples-process-path",
    "rollout_function_path": "--rollout-function-path",
    "multi_lora": "--multi-lora",
}

BUILTIN_DATASETS = ("builtin:reverse4", "builtin:reverse4-heldout", "builtin:copy4", "builtin:arith",
                    "builtin:arith-heldout", "builtin:calc3", "builtin:calc3-heldout", "builtin:sum3",
                    "builtin:sum3-heldout")
BUILTIN_MODELS = ("builtin:tiny-gpt", "builtin:tiny-llama", "builtin:tiny-qwen2", "builtin:tiny-llama3", "builtin:tiny-qwen3",
                  "builtin:tiny-qwen3-moe", "builtin:tiny-glm4-moe")


def check(cfg: RunConfig) -> RunConfig:
    """`cfg` when it keeps every rule of this module, else one ConfigError listing every problem."""
    raise_problems(type_problems(cfg))  # the other rules compare values; a wrong type would raise TypeError
    raise_problems(rule_problems(cfg))
    return cfg


def raise_problems(problems: list[str]) -> None:
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


def type_problems(cfg: RunConfig) -> list[str]:
    return _required(cfg) + _types(cfg)


REQUIRED = (("model", "hf_checkpoint", "--hf-checkpoint"), ("data", "prompt_data", "--prompt-data"),
            ("rollout", "rollout_batch_size", "--rollout-batch-size"), ("run", "num_rollout", "--num-rollout"))


def _required(cfg: RunConfig) -> list[str]:
    """The flags miles requires (its --rollout-batch-size, and a model, data and a length of run to
    mean anything) are required here too; a preset sets them all."""
    missing = [flag for section, name, flag in REQUIRED if getattr(getattr(cfg, section), name) in (None, "")]
    if not missing:
        return []
    return [f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required (as in miles): give "
            f"{'it' if len(missing) == 1 else 'them'}, or start from a preset that sets them: "
            "--preset tiny-reverse4 (the embedded default of ./dev run, a tiny model on CPU) or "
            "--preset smollm2-arith (docs/configuration.md)."]


def rule_problems(cfg: RunConfig) -> list[str]:
    """Every rule's problems: the rules of one section get that section, the others the whole config."""
    rules = (_ranges, _bounds, _finite, _parallel_rules, _driver_rules, _unsupported, _loss_rules, _save_eval_rules,
             _batch_rules, _names, _local_inputs, _uri_schemes, _producer_rules)
    section_rules = ((cfg.train, (_moe_knob_rules, _memory_saving_rules, _routing_replay_rules)),
                     (cfg.metrics, (_metric_mirrors, _trace_rules)))
    return ([problem for rule in rules for problem in rule(cfg)]
            + [problem for section, checks in section_rules for check in checks for problem in check(section)])


def _metric_mirrors(m: MetricsSection) -> list[str]:
    """A mirror that is asked for has its package installed (found now, not at the first metric)."""
    wanted = [("--use-tensorboard", "tensorboard", m.use_tensorboard), ("--use-wandb", "wandb", m.use_wandb)]
    return [f"{flag} needs the `{package}` package: pip install 'miles-flyte[{package}]' (or drop {flag})."
            for flag, package, on in wanted if on and importlib.util.find_spec(package) is None]


def _trace_rules(m: MetricsSection) -> list[str]:
    """The trace's sampling fraction, window and flush interval, and the Prometheus port."""
    p = []
    if not 0.0 < m.trace_sample_groups <= 1.0:
        p.append(f"--trace-sample-groups={m.trace_sample_groups} must be in (0, 1] (use --no-trace to record nothing).")
    if m.trace_window_steps < 0:
        p.append(f"--trace-window-steps={m.trace_window_steps} must be >= 0 (0 keeps every step).")
    if m.trace_flush_seconds <= 0:
        p.append(f"--trace-flush-seconds={m.trace_flush_seconds} must be > 0.")
    if m.prometheus_port is not None and not 0 <= m.prometheus_port <= 65535:
        p.append(f"--prometheus-port={m.prometheus_port} must be a TCP port (0-65535; 0 picks a free one).")
    return p


_KIND_TYPES = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,), "list": (list, tuple)}


def _types(cfg: RunConfig) -> list[str]:
    """Each field holds its declared type (configs also come from JSON and Flyte inputs, not only flags)."""
    p = []
    for s in flag_table():
        value = getattr(getattr(cfg, s.section), s.name)
        if value is None and s.optional:
            continue
        ok = isinstance(value, _KIND_TYPES[s.kind]) and (s.kind == "bool" or not isinstance(value, bool))
        if s.kind == "list" and ok:
            ok = all(isinstance(v, str) for v in value)
        if not ok:
            want = s.kind + (" or none" if s.optional else "") + (" of strings" if s.kind == "list" else "")
            p.append(f"{s.flag}={value!r}: expected {want}, got {type(value).__name__}.")
        elif s.choices and value is not None and value not in s.choices:
            p.append(f"{s.flag}={value!r}: expected one of {', '.join(s.choices)}.")
    return p


def _ranges(cfg: RunConfig) -> list[str]:
    r, b, t, e, run = cfg.rollout, cfg.buffer, cfg.train, cfg.eval, cfg.run
    p = []

    def at_least(value, lo, flag):
        if value is not None and value < lo:
            p.append(f"{flag}={value} must be >= {lo}.")

    at_least(run.num_rollout, 1, "--num-rollout")
    at_least(run.segment_steps, 1, "--segment-steps")
    at_least(r.rollout_batch_size, 1, "--rollout-batch-size")
    at_least(r.n_samples_per_prompt, 1, "--n-samples-per-prompt")
    at_least(r.rollout_max_response_len, 1, "--rollout-max-response-len")
    at_least(cfg.data.max_seq_len, 2, "--max-seq-len")  # one prompt token and one response token
    at_least(r.rollout_temperature, 0.0, "--rollout-temperature")
    at_least(r.max_weight_staleness, 0, "--max-weight-staleness")
    at_least(r.update_weights_interval, 1, "--update-weights-interval")
    p.extend(_engine_count(cfg.engine.rollout_num_engines, b.allow_rollout_producers))
    at_least(t.micro_batch_size, 1, "--micro-batch-size")
    at_least(t.distributed_timeout_minutes, 1, "--distributed-timeout-minutes")
    at_least(t.save_interval, 1, "--save-interval")
    at_least(e.eval_interval, 1, "--eval-interval")
    at_least(e.eval_keep_snapshots, 0, "--eval-keep-snapshots")
    at_least(e.eval_max_in_flight, 1, "--eval-max-in-flight")
    at_least(e.eval_num_gpus, 0, "--eval-num-gpus")
    at_least(e.n_samples_per_eval_prompt, 1, "--n-samples-per-eval-prompt")
    if run.deadline_seconds is not None and run.deadline_seconds <= 0:
        p.append(f"--deadline-seconds={run.deadline_seconds} must be > 0 (omit it for no deadline).")
    p.extend(_lease_timings(run))
    if not 0 < r.rollout_top_p <= 1:
        p.append(f"--rollout-top-p={r.rollout_top_p} must be in (0, 1].")
    if t.lr <= 0:
        p.append(f"--lr={t.lr} must be > 0.")
    if b.async_data_buffer_capacity_factor <= 0:
        p.append(f"--async-data-buffer-capacity-factor={b.async_data_buffer_capacity_factor} must be > 0.")
    elif int(b.async_data_buffer_capacity_factor * r.rollout_batch_size) < 1:
        p.append(
            f"--async-data-buffer-capacity-factor={b.async_data_buffer_capacity_factor} with "
            f"--rollout-batch-size={r.rollout_batch_size} gives a buffer capacity of 0 groups; raise the factor."
        )
    if b.buffer_coalesce_seconds < 0:
        p.append(f"--buffer-coalesce-seconds={b.buffer_coalesce_seconds} must be >= 0.")
    if not 0 <= t.tis_clip_low < t.tis_clip:
        p.append(f"--tis-clip-low={t.tis_clip_low} and --tis-clip={t.tis_clip} need 0 <= low < high.")
    return p


# (section, field, rule, what the rule says): numeric flags without a rule of their own in _ranges.
_POSITIVE, _NON_NEGATIVE = (lambda v: v > 0, "must be > 0"), (lambda v: v >= 0, "must be >= 0")
_AT_LEAST_1 = (lambda v: v >= 1, "must be >= 1")
BOUNDS = [
    ("run", "seed", *_NON_NEGATIVE), ("run", "num_cpus_per_engine", *_NON_NEGATIVE),
    ("run", "num_cpus_trainer", *_NON_NEGATIVE),
    ("model", "tiny_num_layers", *_AT_LEAST_1), ("model", "tiny_hidden_size", *_AT_LEAST_1),
    ("model", "tiny_num_heads", *_AT_LEAST_1),
    ("rollout", "rollout_top_k", lambda v: v == -1 or v >= 1, "must be -1 (off) or >= 1"),
    ("rollout", "engine_request_timeout_seconds", *_POSITIVE), ("rollout", "reward_timeout_seconds", *_POSITIVE),
    ("rollout", "custom_generate_timeout_seconds", *_POSITIVE),
    ("rollout", "max_failed_sample_fraction", lambda v: 0 <= v <= 1, "must be in [0, 1] (1: never fail the run)"),
    ("rollout", "failed_sample_window_steps", *_AT_LEAST_1),
    ("engine", "rollout_num_gpus_per_engine", *_AT_LEAST_1), ("engine", "engine_max_running_requests", *_AT_LEAST_1),
    ("engine", "sglang_mem_fraction_static", lambda v: 0 < v < 1, "must be in (0, 1)"),
    ("engine", "engine_startup_timeout_seconds", *_POSITIVE), ("engine", "weight_anchor_interval", *_AT_LEAST_1),
    ("train", "weight_decay", *_NON_NEGATIVE), ("train", "clip_grad", *_NON_NEGATIVE),
    ("train", "eps_clip", *_POSITIVE), ("train", "eps_clip_high", *_POSITIVE),
    ("train", "entropy_coef", *_NON_NEGATIVE),
    ("eval", "eval_max_response_len", *_AT_LEAST_1), ("eval", "eval_temperature", *_NON_NEGATIVE),
    ("eval", "eval_max_prompts", *_AT_LEAST_1), ("eval", "eval_backpressure_timeout_seconds", *_POSITIVE),
    ("metrics", "metrics_mirror_interval_seconds", *_POSITIVE),
]


def _bounds(cfg: RunConfig) -> list[str]:
    flags = {(s.section, s.name): s.flag for s in flag_table()}
    p = []
    for section, name, ok, rule in BOUNDS:
        value = getattr(getattr(cfg, section), name)
        if value is not None and not ok(value):
            p.append(f"{flags[(section, name)]}={value} {rule}.")
    m = cfg.model
    if m.tiny_num_heads >= 1 and m.tiny_hidden_size % m.tiny_num_heads:
        p.append(f"--tiny-hidden-size={m.tiny_hidden_size} must be a multiple of --tiny-num-heads={m.tiny_num_heads}.")
    return p


def _finite(cfg: RunConfig) -> list[str]:
    """No float flag may be NaN or infinite (every comparison with NaN is False, so ranges miss it)."""
    p = []
    for s in flag_table():
        value = getattr(getattr(cfg, s.section), s.name)
        if s.kind == "float" and value is not None and not math.isfinite(value):
            p.append(f"{s.flag}={value} must be a finite number.")
    return p


def _engine_count(engines: int, producers: bool) -> list[str]:
    """No engine at all is a run whose every group comes from rollout producer jobs."""
    if engines >= 1 or (engines == 0 and producers):
        return []
    if engines == 0:
        return ["--rollout-num-engines=0 needs --allow-rollout-producers: without engines only rollout producer "
                "jobs generate, and they may feed a run only when it allows them."]
    return [f"--rollout-num-engines={engines} must be >= 1 (or 0 with --allow-rollout-producers)."]


def _producer_rules(cfg: RunConfig) -> list[str]:
    """What rollout producer jobs need of the run that allows them."""
    b = cfg.buffer
    if not b.allow_rollout_producers:
        return []
    p = []
    if cfg.driver != "fully-async":
        p.append(f"--allow-rollout-producers with the {cfg.driver} driver is not supported: producer jobs feed the "
                 "fully async driver's buffer (drop --one-step-off / --no-fully-async).")
    if b.custom_async_data_buffer_path:
        p.append("--allow-rollout-producers with --custom-async-data-buffer-path is not supported: producers' groups "
                 "reach the trainer through the durable buffer, which the custom buffer replaces.")
    if b.buffer_delete_consumed_objects:
        p.append("--allow-rollout-producers with --buffer-delete-consumed-objects is not supported: a writer that "
                 "takes over a dead writer's prompt block reads what it committed from its group objects.")
    if cfg.engine.rollout_num_engines == 0 and b.async_unused_samples_handler == "retry":
        p.append("--async-unused-samples-handler=retry with --rollout-num-engines 0 is not supported: a rejected "
                 "group's prompt is retried by the trainer's own engines, and it has none (use drop).")
    if b.prompt_claim_block_size is not None and b.prompt_claim_block_size < 1:
        p.append(f"--prompt-claim-block-size={b.prompt_claim_block_size} must be >= 1.")
    if not b.prompt_claim_ttl_seconds > 0 or not b.producer_poll_seconds > 0:
        p.append(f"--prompt-claim-ttl-seconds={b.prompt_claim_ttl_seconds} and --producer-poll-seconds="
                 f"{b.producer_poll_seconds} must be > 0.")
    return p


def _lease_timings(run) -> list[str]:
    try:
        check_timings(run.lease_ttl_seconds, run.lease_renew_seconds)
    except ValueError as e:
        return [f"--lease-ttl-seconds={run.lease_ttl_seconds} / --lease-renew-seconds={run.lease_renew_seconds}: {e}."]
    return []


def _parallel_rules(cfg: RunConfig) -> list[str]:
    """Trainer layout: ranks = nodes x per-node ranks = TP x DP; PP and CP are not built."""
    t = cfg.train
    p = []
    for value, flag in ((t.actor_num_nodes, "--actor-num-nodes"), (t.actor_num_gpus_per_node, "--actor-num-gpus-per-node"),
                        (t.tensor_model_parallel_size, "--tensor-model-parallel-size")):
        if value < 1:
            p.append(f"{flag}={value} must be >= 1.")
    for value, flag in ((t.pipeline_model_parallel_size, "--pipeline-model-parallel-size"),
                        (t.context_parallel_size, "--context-parallel-size")):
        if value != 1:
            p.append(f"{flag}={value} is not supported: the trainer builds tensor and data parallelism only; use 1.")
    world = t.actor_num_nodes * t.actor_num_gpus_per_node
    if world >= 1 and t.tensor_model_parallel_size >= 1 and world % t.tensor_model_parallel_size:
        p.append(f"--tensor-model-parallel-size={t.tensor_model_parallel_size} must divide the trainer's "
                 f"{world} ranks (--actor-num-nodes x --actor-num-gpus-per-node).")
    elif (cfg.engine.engine_backend == "sglang" and t.actor_num_gpus_per_node >= 1 and t.tensor_model_parallel_size >= 1
          and t.actor_num_gpus_per_node % t.tensor_model_parallel_size):
        # GPU runs place each trainer node's ranks on one node (driver/placement.py); a TP group is consecutive ranks
        p.append(f"--tensor-model-parallel-size={t.tensor_model_parallel_size} must divide the trainer's ranks per node "
                 f"(--actor-num-gpus-per-node={t.actor_num_gpus_per_node}): each trainer node's ranks are placed on one "
                 "node and a tensor-parallel group would cross nodes.")
    p.extend(_expert_parallel_rules(t, world))
    if cfg.engine.update_weight_buffer_size < 1:
        p.append(f"--update-weight-buffer-size={cfg.engine.update_weight_buffer_size} must be >= 1 (bytes).")
    return p


def _expert_parallel_rules(t, world: int) -> list[str]:
    """Megatron's layout of the routed experts (parallel_state.initialize_model_parallel, megatron-core
    0.16.1): expert TP x EP ranks hold one copy of every expert, so their product divides the trainer's
    ranks (the rest is expert data parallelism); the dense layers keep TP x DP over the same ranks. Only
    the default expert TP size (the dense TP size) is built."""
    ep, etp, tp = t.expert_model_parallel_size, t.expert_tensor_parallel_size, t.tensor_model_parallel_size
    if ep < 1:
        return [f"--expert-model-parallel-size={ep} must be >= 1."]
    if etp is not None and etp != tp:
        return [f"--expert-tensor-parallel-size={etp} is not supported with --tensor-model-parallel-size={tp}: the "
                f"routed experts are split like the dense MLPs (expert TP = TP); drop it or pass {tp}."]
    if world >= 1 and tp >= 1 and world % (ep * tp):
        return [f"--expert-model-parallel-size={ep} x --tensor-model-parallel-size={tp} (the expert tensor parallel "
                f"size) = {ep * tp} must divide the trainer's {world} ranks (--actor-num-nodes x "
                "--actor-num-gpus-per-node): each group of that many ranks holds every expert once."]
    if ep > 1 and t.use_distributed_optimizer:
        return [f"--use-distributed-optimizer with --expert-model-parallel-size={ep} is not supported: checkpoints "
                "gather the sharded optimizer state onto DP rank 0, and the experts' (sharded over expert DP) "
                "would need a file of their own per EP rank; drop one of them."]
    return []


def _moe_knob_rules(t: TrainSection) -> list[str]:
    """The --moe-* flags that choose how the trainer runs (not what the model is): each is what the
    trainer does, or refused by name."""
    p = []
    if t.moe_token_dispatcher_type != "alltoall":
        p.append(f"--moe-token-dispatcher-type={t.moe_token_dispatcher_type} is not supported: tokens reach their "
                 "experts through Megatron's alltoall dispatcher (use alltoall, the default).")
    if t.moe_router_dtype not in (None, "fp32"):
        p.append(f"--moe-router-dtype={t.moe_router_dtype} is not supported: the router always runs in fp32.")
    if t.moe_router_bias_update_rate != 0:
        p.append(f"--moe-router-bias-update-rate={t.moe_router_bias_update_rate} is not supported: the expert bias is "
                 "a checkpoint weight (GLM's e_score_correction_bias) kept as loaded; use 0.")
    if t.moe_aux_loss_coeff is not None and t.moe_aux_loss_coeff < 0:
        p.append(f"--moe-aux-loss-coeff={t.moe_aux_loss_coeff} must be >= 0.")
    return p


# (TrainSection field, ModelSpec field, what the checkpoint's config.json calls it): the miles model
# flags that describe the model. Given, each must say what the checkpoint is.
MOE_MODEL_FLAGS = (
    ("num_experts", "num_experts", "num_experts / n_routed_experts"),
    ("moe_router_topk", "moe_topk", "num_experts_per_tok"),
    ("moe_ffn_hidden_size", "moe_ffn_hidden_size", "moe_intermediate_size"),
    ("moe_shared_expert_intermediate_size", "shared_expert_ffn_hidden_size", "the shared experts' width"),
    ("moe_router_score_function", "router_score", "the family's router"),
    ("moe_router_topk_scaling_factor", "routed_scaling_factor", "routed_scaling_factor"),
    ("moe_router_num_groups", "router_groups", "n_group"),
    ("moe_router_group_topk", "router_group_topk", "topk_group"),
)


def moe_flag_problems(spec, train) -> list[str]:
    """What the --moe-* model flags and --expert-model-parallel-size need of the model `spec` (a
    ModelSpec, read from the checkpoint's config.json): each model flag given equals the checkpoint's
    value (both named), a dense model takes none of them, and the load-balancing type is one the
    trainer computes. The checks before a run (miles_core.prepare.checks) and the trainer run it."""
    given = [(flag, getattr(train, flag)) for flag, _, _ in MOE_MODEL_FLAGS if getattr(train, flag) is not None]
    given += [(f, v) for f in ("moe_layer_freq", "moe_router_pre_softmax", "moe_router_enable_expert_bias")
              if (v := getattr(train, f)) not in (None, False, "")]
    ep = train.expert_model_parallel_size
    if not spec.moe:
        p = [f"--{f.replace('_', '-')}={v} describes a mixture-of-experts model; the checkpoint ({spec.family}) is "
             "dense: drop it." for f, v in given]
        if ep > 1:
            p.append(f"--expert-model-parallel-size={ep}: the checkpoint ({spec.family}) has no experts; expert "
                     "parallelism needs a mixture-of-experts model.")
        if train.use_rollout_routing_replay:
            p.append(f"--use-rollout-routing-replay: the checkpoint ({spec.family}) is dense; routing replay needs a "
                     "mixture-of-experts model (it has no routers to replay).")
        return p
    p = []
    if train.tensor_model_parallel_size > 1 and not train.sequence_parallel:
        p.append(f"--tensor-model-parallel-size={train.tensor_model_parallel_size} with a mixture-of-experts model "
                 "needs --sequence-parallel: Megatron's MoE layer refuses to train under TP without it (each TP rank "
                 "would dispatch every token).")
    if spec.num_experts % ep:
        p.append(f"--expert-model-parallel-size={ep} must divide the checkpoint's {spec.num_experts} routed experts "
                 "(each expert-parallel rank holds an equal contiguous block of them).")
    grouped = spec.router_groups > 1
    for flag, field, hf_name in MOE_MODEL_FLAGS:
        want, have = getattr(spec, field), getattr(train, flag)
        if field in ("router_groups", "router_group_topk") and not grouped:  # 0 or 1 group: no grouped top-k
            want, have = 0, 0 if have in (None, 0, 1) else have
        if have is not None and have != want:
            p.append(f"--{flag.replace('_', '-')}={have} does not match the checkpoint's {hf_name} = {want}.")
    p.extend(_moe_layer_freq_problems(spec, train.moe_layer_freq))
    if train.moe_router_pre_softmax and spec.router_score == "softmax" and spec.norm_topk_prob:
        p.append("--moe-router-pre-softmax does not match the checkpoint's norm_topk_prob = true (pre-softmax means "
                 "the chosen experts' weights are not renormalised); drop it.")
    if train.moe_router_enable_expert_bias and not spec.expert_bias:
        p.append(f"--moe-router-enable-expert-bias: the checkpoint ({spec.family}) has no expert-score correction "
                 "bias (e_score_correction_bias); drop it.")
    p.extend(_load_balancing_problems(spec, train))
    return p


def moe_layer_pattern(value: str, num_layers: int) -> list[int]:
    """Megatron's --moe-layer-freq: an integer N (layer i is a MoE layer when i % N == 0) or a per-layer
    list written as list literals joined by + and repeated by * (`[0]*3+[1]*45`), read without eval.
    ValueError when it is neither."""
    import ast

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            return a + b if isinstance(node.op, ast.Add) else a * b
        raise ValueError(value)

    try:
        out = ev(ast.parse(value.strip(), mode="eval").body)
    except SyntaxError:
        raise ValueError(value) from None
    if isinstance(out, int):
        if out < 1:
            raise ValueError(value)
        return [int(i % out == 0) for i in range(num_layers)]
    if not all(v in (0, 1) for v in out):
        raise ValueError(value)
    return out


def _moe_layer_freq_problems(spec, value: str) -> list[str]:
    if not value:
        return []
    want = [int(spec.is_moe_layer(i)) for i in range(spec.num_layers)]
    try:
        have = moe_layer_pattern(value, spec.num_layers)
    except ValueError:
        return [f"--moe-layer-freq={value!r}: expected an integer N (every N-th layer) or a pattern of 0/1 lists "
                "such as [0]*1+[1]*45."]
    if have != want:
        return [f"--moe-layer-freq={value!r} gives the MoE layers {[i for i, m in enumerate(have) if m]} of "
                f"{len(have)}; the checkpoint's {spec.num_layers} layers have them at "
                f"{[i for i, m in enumerate(want) if m]}."]
    return []


def _load_balancing_problems(spec, train) -> list[str]:
    """The trainer computes one load-balancing loss (Megatron's aux_loss: transformers' own); another
    type is accepted only where no aux loss is computed at all."""
    kind = train.moe_router_load_balancing_type
    if kind in ("aux_loss", "none"):
        return []
    coeff = train.moe_aux_loss_coeff if train.moe_aux_loss_coeff is not None else spec.aux_loss_coef
    if coeff:
        return [f"--moe-router-load-balancing-type={kind} is not supported with an aux loss coefficient of {coeff} "
                "(--moe-aux-loss-coeff, default the checkpoint's router_aux_loss_coef): the trainer computes "
                "aux_loss (transformers' load-balancing loss); use aux_loss, or none / --moe-aux-loss-coeff 0."]
    return []


def moe_aux_loss_coeff(train) -> float | None:
    """The Megatron aux loss coefficient the trainer builds with: 0 under --moe-router-load-balancing-type
    none (or another type, accepted only without an aux loss), --moe-aux-loss-coeff when given, else
    None (the model's own, derived from the checkpoint)."""
    if train.moe_router_load_balancing_type != "aux_loss":
        return 0.0
    return train.moe_aux_loss_coeff


def _routing_replay_rules(t: TrainSection) -> list[str]:
    """--use-rollout-routing-replay replays the engine's routes in the forward the loss is taken from;
    full recomputation runs every router again in the backward, outside that replay."""
    if t.use_rollout_routing_replay and t.recompute_granularity == "full":
        return ["--use-rollout-routing-replay with --recompute-granularity=full is not supported: the recomputed "
                "forward in the backward would route by the trainer's own choice, not the engine's (selective "
                "recomputation, which recomputes only the core attention, is)."]
    return []


def _memory_saving_rules(t: TrainSection) -> list[str]:
    """Megatron's own checks of --recompute-* (TransformerConfig.__post_init__, megatron-core 0.16.1;
    selective taking no method is Megatron-LM's arguments check) and of --sequence-parallel
    (ModelParallelConfig.__post_init__), here so that they fail before anything starts. Whether
    --recompute-num-layers fits the model's layers is checked when the model is built."""
    granularity, method, layers = t.recompute_granularity, t.recompute_method, t.recompute_num_layers
    p = []
    if granularity == "full" and (method is None or layers is None):
        p.append("--recompute-granularity=full needs --recompute-method (uniform or block) and "
                 "--recompute-num-layers (e.g. --recompute-method uniform --recompute-num-layers 1).")
    if granularity == "selective" and (method is not None or layers is not None):
        p.append("--recompute-granularity=selective takes neither --recompute-method nor --recompute-num-layers "
                 "(it recomputes the core attention of every layer); drop them.")
    if granularity is None and (method is not None or layers is not None):
        p.append("--recompute-method and --recompute-num-layers need --recompute-granularity=full.")
    if layers is not None and layers < 1:
        p.append(f"--recompute-num-layers={layers} must be >= 1.")
    if t.sequence_parallel and t.tensor_model_parallel_size <= 1:
        p.append("--sequence-parallel needs --tensor-model-parallel-size > 1: it splits the sequence over the "
                 "tensor-parallel ranks; drop --sequence-parallel or raise --tensor-model-parallel-size.")
    return p


def _driver_rules(cfg: RunConfig) -> list[str]:
    r, run = cfg.rollout, cfg.run
    p = []
    if run.fully_async and run.one_step_off:
        p.append("--fully-async and --one-step-off are different drivers; pick one (--no-fully-async for one-step-off).")
    if run.fully_async:
        if r.pause_generation_mode == "abort":
            p.append("--fully-async excludes --pause-generation-mode=abort (it would throw away in-flight work); "
                     "use retract or in_place.")
    if r.max_weight_staleness == 0 and (run.fully_async or run.one_step_off):
        p.append("--max-weight-staleness=0 needs the sync driver: under --fully-async or --one-step-off the next "
                 "batch is generated before the weight update it is trained after, so it is always >= 1 version "
                 "old and no group could ever be consumed; use >= 1 or --no-fully-async.")
    if r.async_max_concurrent_samples is not None and r.async_max_concurrent_samples < r.n_samples_per_prompt:
        p.append(
            f"--async-max-concurrent-samples={r.async_max_concurrent_samples} must be >= "
            f"--n-samples-per-prompt={r.n_samples_per_prompt}: a group's samples run together."
        )
    if cfg.eval.eval_num_gpus > 0 and cfg.eval.eval_mode != "dedicated":
        p.append(f"--eval-num-gpus={cfg.eval.eval_num_gpus} needs --eval-mode=dedicated.")
    return p


def _unsupported(cfg: RunConfig) -> list[str]:
    """Flags miles users know that this project does not implement: refused by name, under every
    driver. Under --fully-async the message keeps naming the driver (docs/configuration.md's matrix)."""
    run = cfg.run
    p = []
    for name, flag in FULLY_ASYNC_EXCLUDES.items():
        if not getattr(run, name):
            continue
        if run.fully_async:
            p.append(f"--fully-async excludes {flag}, and {flag} is not supported by the sync drivers either: "
                     f"drop {flag}.")
        else:
            p.append(f"{flag} is not supported: the {cfg.driver} driver does not implement it; drop {flag}.")
    if cfg.train.advantage_estimator == "ppo":
        p.append("--advantage-estimator=ppo is not supported: the trainer has no critic (value model); "
                 "use --advantage-estimator=grpo.")
    if cfg.rollout.rm_type and not rm_type_supported(cfg.rollout.rm_type):
        p.append(f"--rm-type={cfg.rollout.rm_type} is not supported: supported are {', '.join(RM_TYPES)} "
                 f"(each also as boxed_NAME), remote_rm with --rm-url, or your own --custom-rm-path module:function.")
    if (cfg.rollout.rm_type == REMOTE_RM) != bool(cfg.rollout.rm_url):
        p.append("--rm-type remote_rm and --rm-url go together (as in miles): the reward model's URL, and the "
                 "reward type that calls it.")
    if cfg.rollout.rm_url and not cfg.rollout.rm_url.startswith(("http://", "https://")):
        p.append(f"--rm-url={shown_url(cfg.rollout.rm_url)!r} must be an http:// or https:// URL.")
    t = cfg.train
    if t.kl_coef < 0:
        p.append(f"--kl-coef={t.kl_coef} must be >= 0.")
    elif t.kl_coef != 0 and not t.advantage_estimator.startswith("reinforce_plus_plus"):
        p.append(f"--kl-coef={t.kl_coef} (the KL in the reward) is read by the reinforce_plus_plus estimators only "
                 f"(miles' {t.advantage_estimator} ignores it): with --advantage-estimator={t.advantage_estimator} "
                 "use --use-kl-loss --kl-loss-coef (docs/algorithms.md).")
    return p


def _loss_rules(cfg: RunConfig) -> list[str]:
    t = cfg.train
    p = []
    if t.use_rollout_logprobs and t.use_tis:
        p.append("--use-rollout-logprobs excludes --use-tis (TIS reweights against the rollout log-probs "
                 "itself); pass --no-use-rollout-logprobs with --use-tis, or drop --use-tis.")
    if t.advantage_estimator in ("grpo", "gspo", "reinforce_plus_plus_baseline") and cfg.rollout.n_samples_per_prompt < 2:
        p.append(f"--advantage-estimator={t.advantage_estimator} needs --n-samples-per-prompt >= 2 (a group of one "
                 "has no baseline).")
    if t.advantage_estimator.startswith("reinforce_plus_plus") and not t.normalize_advantages:
        p.append(f"--advantage-estimator={t.advantage_estimator} needs --normalize-advantages (as in miles: its "
                 "advantages are whitened over the batch).")
    if not 0.0 < t.gamma <= 1.0:
        p.append(f"--gamma={t.gamma} must be in (0, 1].")
    if t.kl_loss_coef < 0:
        p.append(f"--kl-loss-coef={t.kl_loss_coef} must be >= 0 (0 with --use-kl-loss: the KL is measured, not penalised).")
    return p + _correction_rules(t)


# the MIS settings (miles' mis.yaml keys), read only by a --custom-tis-function-path correction
MIS_FIELDS = ("tis_level", "tis_mode", "tis_lower_bound", "tis_upper_bound", "use_rs", "rs_level", "rs_lower_bound",
              "rs_upper_bound", "rs_veto_threshold", "tis_batch_normalize")


def _correction_rules(t) -> list[str]:
    p = []
    if t.custom_tis_function_path and not (t.use_tis or t.get_mismatch_metrics):
        p.append("--custom-tis-function-path is called only with --use-tis (or --get-mismatch-metrics); add one.")
    if t.custom_tis_function_path and t.use_decoupled_loss:
        p.append("--custom-tis-function-path replaces --use-tis's weight; --use-decoupled-loss has its own behaviour "
                 "weight (exp(prox - rollout), truncated): use one of them.")
    if t.get_mismatch_metrics and not t.custom_tis_function_path:
        p.append("--get-mismatch-metrics needs --custom-tis-function-path (the function whose metrics it logs), "
                 "as in miles.")
    default = type(t)()
    changed = [f for f in MIS_FIELDS if getattr(t, f) != getattr(default, f)]
    if changed and not t.custom_tis_function_path:
        names = ", ".join("--" + f.replace("_", "-") for f in changed)
        p.append(f"{names}: read only by a --custom-tis-function-path correction (miles' MIS: "
                 "miles_core.train.corrections.compute_mis_weights_with_cp); set one, or drop them.")
    if t.tis_upper_bound <= 0:
        p.append(f"--tis-upper-bound={t.tis_upper_bound} must be > 0.")
    low = t.tis_lower_bound if t.tis_lower_bound is not None else 1.0 / t.tis_upper_bound if t.tis_upper_bound > 0 else 0
    if t.tis_mode in ("clip", "mask") and not 0 <= low < t.tis_upper_bound:
        p.append(f"--tis-lower-bound={low:g} and --tis-upper-bound={t.tis_upper_bound:g} need 0 <= lower < upper.")
    rs_low = t.rs_lower_bound if t.rs_lower_bound is not None else low
    rs_high = t.rs_upper_bound if t.rs_upper_bound is not None else t.tis_upper_bound
    if t.use_rs and not 0 <= rs_low < rs_high:
        p.append(f"--rs-lower-bound={rs_low:g} and --rs-upper-bound={rs_high:g} need 0 <= lower < upper.")
    if t.rs_veto_threshold is not None and not t.rs_veto_threshold > 0:
        p.append(f"--rs-veto-threshold={t.rs_veto_threshold} must be > 0.")
    if t.tis_batch_normalize and t.tis_level == "geometric":
        p.append("--tis-batch-normalize needs --tis-level token or sequence (as miles' MIS).")
    return p


def _save_eval_rules(cfg: RunConfig) -> list[str]:
    t, e = cfg.train, cfg.eval
    p = []
    if t.save_interval is not None and not t.save:
        p.append("--save-interval needs a save location: set --save (a URI, or 'auto' for the run root).")
    if t.save_hf and not t.save:
        p.append("--save-hf needs --save (HF checkpoints are written beside trainer checkpoints).")
    if e.eval_interval is not None and not e.eval_prompt_data:
        p.append("--eval-interval needs eval datasets: set --eval-prompt-data name=uri [...].")
    if t.save_hf and e.eval_interval is not None:  # reuse mode: evals read the --save-hf checkpoints
        if t.save_interval is None:
            p.append("--save-hf (eval reuse mode) with --eval-interval needs --save-interval.")
        elif e.eval_interval % t.save_interval != 0:
            p.append(
                f"eval reuse mode (--save-hf) needs --eval-interval % --save-interval == 0, got "
                f"{e.eval_interval} % {t.save_interval} = {e.eval_interval % t.save_interval}: evals reuse the "
                "saved HF checkpoints, so every eval step must be a save step."
            )
    if t.save_hf and e.eval_hf_dir:
        p.append("--save-hf (reuse mode) and --eval-hf-dir (export mode) are exclusive; pick one.")
    if e.eval_mode == "dedicated" and e.eval_num_gpus < 1:
        p.append("--eval-mode=dedicated needs --eval-num-gpus >= 1.")
    return p


def _batch_rules(cfg: RunConfig) -> list[str]:
    """miles' --global-batch-size, and the token budget of --use-dynamic-batch-size."""
    t, r = cfg.train, cfg.rollout
    p = []
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    if t.global_batch_size is not None:
        if t.global_batch_size < 1:
            p.append(f"--global-batch-size={t.global_batch_size} must be >= 1 (samples per optimizer step).")
        elif samples % t.global_batch_size:
            p.append(f"--global-batch-size={t.global_batch_size} must divide --rollout-batch-size x "
                     f"--n-samples-per-prompt = {samples} (a rollout gives that / it optimizer steps).")
    return p + _token_budget_rules(t)


def _token_budget_rules(t) -> list[str]:
    """--use-dynamic-batch-size needs a budget; a budget without it would be ignored, so it is refused."""
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu is None:
        return ["--use-dynamic-batch-size needs --max-tokens-per-gpu N (tokens per micro-batch per GPU)."]
    if t.max_tokens_per_gpu is not None and not t.use_dynamic_batch_size:
        return [f"--max-tokens-per-gpu={t.max_tokens_per_gpu} is only used with --use-dynamic-batch-size: "
                "add --use-dynamic-batch-size, or drop --max-tokens-per-gpu (micro-batches are then "
                "--micro-batch-size samples)."]
    if t.max_tokens_per_gpu is not None and t.max_tokens_per_gpu < 1:
        return [f"--max-tokens-per-gpu={t.max_tokens_per_gpu} must be >= 1."]
    return []


def _names(cfg: RunConfig) -> list[str]:
    p = []
    try:
        validate_name(cfg.run.run_id, "--run-id")
    except InvalidName as ex:
        p.append(str(ex))
    seen = set()
    for item in cfg.eval.eval_prompt_data:
        name, sep, uri = item.partition("=")
        if not sep or not uri:
            p.append(f"--eval-prompt-data {item!r}: expected name=uri (e.g. heldout=builtin:reverse4-heldout).")
            continue
        try:
            validate_name(name, "--eval-prompt-data")
        except InvalidName as ex:
            p.append(str(ex))
        if name in seen:
            p.append(f"--eval-prompt-data: dataset name {name!r} given twice.")
        seen.add(name)
        if uri.startswith("builtin:") and uri not in BUILTIN_DATASETS:
            p.append(f"--eval-prompt-data {item!r}: unknown builtin dataset; known: {', '.join(BUILTIN_DATASETS)}.")
    if cfg.data.prompt_data.startswith("builtin:") and cfg.data.prompt_data not in BUILTIN_DATASETS:
        p.append(f"--prompt-data={cfg.data.prompt_data!r}: unknown builtin dataset; known: {', '.join(BUILTIN_DATASETS)}.")
    if cfg.model.hf_checkpoint.startswith("builtin:") and cfg.model.hf_checkpoint not in BUILTIN_MODELS:
        p.append(f"--hf-checkpoint={cfg.model.hf_checkpoint!r}: unknown builtin model; known: {', '.join(BUILTIN_MODELS)}.")
    return p


def _inputs(cfg: RunConfig) -> list[tuple[str, str]]:
    """(flag, path or URI) of everything the run reads from outside its run root."""
    return [("--prompt-data", cfg.data.prompt_data), ("--hf-checkpoint", cfg.model.hf_checkpoint),
            ("--ref-load", cfg.train.ref_load),
            *(("--eval-prompt-data", item.partition("=")[2]) for item in cfg.eval.eval_prompt_data)]


def _local_inputs(cfg: RunConfig) -> list[str]:
    """Inputs on this machine's filesystem (a plain path or file://) must exist now, before any cluster
    starts; object-store URIs are checked where they are first read (the data and model steps, which
    run before any actor starts)."""
    p = []
    for flag, value in _inputs(cfg):
        path = _local_path(value)
        if path is not None and not os.path.exists(path):
            p.append(f"{flag}={value!r}: no such file or directory.")
    return p


def _uri_schemes(cfg: RunConfig) -> list[str]:
    """Every URI's scheme names a filesystem this install can open (a typo such as `s4://` or `htps://`
    would otherwise surface only when the first task reads it). No network call: cheap at validation."""
    p = []
    for flag, value in [("--storage-root", cfg.run.storage_root), *_inputs(cfg)]:
        if "://" not in (value or ""):
            continue
        scheme = value.partition("://")[0]
        try:
            fsspec.get_filesystem_class(scheme)
        except (ValueError, ImportError) as e:
            p.append(f"{flag}={value!r}: the scheme '{scheme}://' cannot be opened here ({e}).")
    return p


def _local_path(value: str) -> str | None:
    if not value or value.startswith(("builtin:", "import:")):
        return None
    if value.startswith("file://"):
        return value[len("file://"):]
    return None if "://" in value else value


def recompute_layers_problem(num_layers: int, method: str | None, recompute_num_layers: int | None) -> str | None:
    """Why --recompute-num-layers does not fit a model of `num_layers` layers (None when it does):
    uniform runs chunks of that many layers (Megatron indexes past the last layer otherwise), block
    recomputes the first that many."""
    if method is None or recompute_num_layers is None:
        return None
    if method == "uniform" and num_layers % recompute_num_layers:
        return (f"--recompute-num-layers={recompute_num_layers} must divide the model's {num_layers} layers "
                "under --recompute-method=uniform (layers per recomputed chunk)")
    if method == "block" and recompute_num_layers > num_layers:
        return (f"--recompute-num-layers={recompute_num_layers} must be at most the model's {num_layers} layers "
                "under --recompute-method=block (layers recomputed)")
    return None


def shown_url(url: str) -> str:
    """A URL without its query string or credentials (an error message must not print a secret)."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    return f"{u.scheme}://{u.hostname or ''}{u.path}" if u.scheme else url.split("?", 1)[0].split("@")[-1]
