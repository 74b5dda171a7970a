"""miles / slime flags that miles-flyte does not implement, each refused by name with what to use
instead (docs/real-model.md: never accepted and ignored). A miles recipe's command line then fails with
one line per such flag instead of a bare "unknown flag"."""

NOT_SUPPORTED: dict[str, str] = {
    "--reward-key": "return the reward value from --custom-rm-path",
    "--rollout-num-gpus": "use --rollout-num-engines x --rollout-num-gpus-per-engine",
    "--moe-grouped-gemm": "the trainer's routed experts are Megatron's SequentialMLP (one MLP per expert, the "
                          "checkpoint's names); drop it",
    "--moe-permute-fusion": "the token permutation runs unfused (the fused kernel is Transformer Engine's); drop it",
    "--moe-token-drop-policy": "no token is ever dropped (there is no expert capacity); drop it",
    "--moe-expert-capacity-factor": "experts have no capacity limit: every token reaches its top-k experts",
    "--moe-pad-expert-input-to-capacity": "experts have no capacity limit: every token reaches its top-k experts",
    "--moe-enable-deepep": "tokens are dispatched by Megatron's alltoall dispatcher (--moe-token-dispatcher-type)",
    "--moe-shared-expert-overlap": "the shared experts run after the routed ones, not overlapped with dispatch",
    "--moe-router-fusion": "the router runs unfused (the fused kernel is Transformer Engine's); drop it",
    "--moe-z-loss-coeff": "the only router loss is the load-balancing aux loss (--moe-aux-loss-coeff)",
    "--moe-input-jitter-eps": "the router adds no jitter (log-probs must match the engine's)",
    "--moe-use-legacy-grouped-gemm": "the trainer's routed experts are Megatron's SequentialMLP",
    "--moe-layer-recompute": "use --recompute-granularity (full or selective)",
    "--disable-grpo-std-normalization": "spell it --no-normalize-advantages-std",
    "--disable-rewards-normalization": "the group mean is always subtracted (grpo, gspo, "
                                       "reinforce_plus_plus_baseline); use reinforce_plus_plus for raw rewards",
    "--optimizer": "the optimizer is Adam(W) always",
    "--lr-decay-style": "the learning rate is constant",
    "--adam-beta1": "Adam betas are fixed at (0.9, 0.999)",
    "--adam-beta2": "Adam betas are fixed at (0.9, 0.999)",
    "--attention-dropout": "dropout is always 0 in RL training here",
    "--hidden-dropout": "dropout is always 0 in RL training here",
    "--accumulate-allreduce-grads-in-fp32": "gradients are always reduced in fp32",
    "--attention-softmax-in-fp32": "the attention softmax is computed in fp32 on CPU and by the GPU kernels' own rule",
    "--attention-backend": "the attention backend is chosen by the trainer (local on CPU, TE/flash on GPU)",
    "--rollout-max-prompt-len": "use --max-seq-len (prompts that leave no room for a response are dropped)",
    "--rollout-max-context-len": "use --max-seq-len",
    "--num-steps-per-rollout": "use --global-batch-size (rollout samples / it = optimizer steps)",
    "--wandb-key": "the W&B key is read only from WANDB_API_KEY (or the Flyte secret named by "
                   "MILES_WANDB_API_KEY_SECRET), never from a flag, which would write it into config.json",
    "--wandb-host": "set WANDB_BASE_URL in the environment",
    "--wandb-team": "set WANDB_ENTITY in the environment",
    "--tb-project-name": "use --tensorboard-dir",
    "--tb-experiment-name": "use --tensorboard-dir",
}


def not_supported_message(flag: str) -> str | None:
    hint = NOT_SUPPORTED.get(flag)
    return None if hint is None else f"{flag} (a miles flag) is not supported by miles-flyte: {hint}."


# miles' --rm-type values implemented by miles_core.rollout.rm_types (each also as boxed_NAME)
RM_TYPES = ("math", "deepscaler", "dapo", "f1")
BOXED = "boxed_"
REMOTE_RM = "remote_rm"  # the reward model at --rm-url (miles_core.rollout.remote_rm)


def rm_type_supported(name: str) -> bool:
    return name == REMOTE_RM or name.removeprefix(BOXED) in RM_TYPES
