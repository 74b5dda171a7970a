"""The RL trainer: one optimizer step per batch of prompt groups, on a Megatron-core GPTModel.

`Trainer(train_section, hf_dir, seed=...)` loads an HF checkpoint through the converter.
`train_step(step, groups)` turns groups into prompt+response sequences (failed/aborted samples
and samples without a reward are excluded, GRPO advantages are computed over the rest of each
group), runs micro-batches of `micro_batch_size` samples (right-padded; or, with
`use_dynamic_batch_size`, packed rows of at most `max_tokens_per_gpu` tokens: train/packing.py)
with the loss over response tokens whose `loss_mask` is 1, clips the gradient norm and steps once.
`export_hf(dir)` writes an HF checkpoint; `checkpoint_state()` / `load_checkpoint_state()` are what
checkpoint.py stores. For a mixture-of-experts model, --expert-model-parallel-size spreads the routed
experts over EP ranks (docs/training.md#expert-parallelism): each rank loads, trains and checkpoints
its own, and an export gathers them all.
On CPU: fp32, plain `torch.optim.AdamW`. On GPU, and on CPU with --bf16 or
--use-distributed-optimizer: Megatron DDP + Megatron's optimizer (`megatron_model.build_training`;
on CPU inside `cpu_shim.megatron_on_cpu`).

One Trainer per rank (miles_core.driver.placement places them). Each rank trains on its data-parallel
part of the rollout (`train_part`; miles_core.rank_batches cuts the parts on the rollout side); the loss
is normalised by the global token count and gradients are summed over DP ranks, so DP=N makes the DP=1
update. Collectives (`train_step` or `train_part`, `hf_state_dict`, `logprobs`, checkpoint save) must be
called on every rank.
Use it as a context manager (or call `close()`) to release the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import time

import torch
from megatron.core.distributed import finalize_model_grads
from safetensors.torch import save_file

from miles_core.config.rules import moe_aux_loss_coeff, moe_flag_problems
from miles_core.metrics import names as N
from miles_core.metrics import trace
from miles_core.rank_batches import (ESTIMATORS, AdvantageSettings, DataLayout, RankBatch, RankStep, kl_reward_advantages,
                                    split_rollout, whiten_with, whitening_sums)
from miles_core.rank_batches import loss_mask as _loss_mask
from miles_core.rank_batches import sequence_length as _length
from miles_core.samples import Group, Sample
from miles_core.train import data_parallel as DP
from miles_core.train import collectives, hf_convert, hf_shards, packing
from miles_core.train.cpu_shim import megatron_on_cpu
from miles_core.train.losses import (LossConfig, approx_kl, finalize_metrics, policy_loss, response_positions,
                                     sum_keys)
from miles_core.train.megatron_model import (ModelSpec, build_model, build_training, has_moe_aux_loss,
                                            masked_token_logprobs, moe_aux_loss_value, scale_moe_aux_loss,
                                            unwrap)
from miles_core.train.optimizer_state import load_optimizer_state, optimizer_state
from miles_core.train.routing_replay import Seen, batch_routes, replaying

WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


class TrainError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


class Trainer:
    def __init__(self, train, hf_dir: str, *, seed: int = 1, optimizer_steps: int = 1):
        if train.advantage_estimator not in ESTIMATORS:
            raise TrainError(f"--advantage-estimator={train.advantage_estimator}: not supported (a critic is not "
                             f"implemented); use one of {', '.join(ESTIMATORS)}.")
        self.cfg = train
        self.optimizer_steps = optimizer_steps  # per rollout (--global-batch-size)
        self.loss_cfg = LossConfig.from_section(train)
        self.advantages = AdvantageSettings.from_section(train)
        self.hf_dir = hf_dir
        # config.json, tokenizer files...: read once, so exports never need the local copy again
        # (a node cache may be cleaned under a running trainer)
        self.aux_files = non_weight_files(hf_dir)
        self.hf_config = hf_convert.read_hf_config(hf_dir)
        self.spec = ModelSpec.from_hf_config(self.hf_config)
        problems = moe_flag_problems(self.spec, train)  # checked before the run too; here for every way in
        if problems:
            raise TrainError("; ".join(problems))
        self.cuda = torch.cuda.is_available()
        self.bf16 = self.cuda or train.bf16
        # Megatron's DDP and optimizer: always on GPU; on CPU for what only they implement
        self.megatron_optimizer = self.cuda or train.bf16 or train.use_distributed_optimizer
        self.tp = train.tensor_model_parallel_size
        self.ep = train.expert_model_parallel_size
        torch.manual_seed(seed)
        random.seed(seed)
        build = dict(tensor_model_parallel_size=self.tp, bf16=self.bf16, seed=seed, train=train,
                     expert_model_parallel_size=self.ep, moe_aux_loss_coeff=moe_aux_loss_coeff(train))
        model = build_model(self.spec, **build)
        self.ref_model = None
        if train.use_kl_loss or self.advantages.kl_in_reward:  # the reference is the initial checkpoint, frozen
            self.ref_model = build_model(self.spec, **build)
            self.ref_model.eval().requires_grad_(False)
        hf_shards.load_hf_checkpoint([model, self.ref_model], self.spec, hf_dir)  # this TP/EP rank's part, read once
        self.model, self.optimizer = self._training(model)
        self.device = torch.device("cuda") if self.cuda else torch.device("cpu")
        from megatron.core import parallel_state as ps

        self.dp_size, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_group = ps.get_data_parallel_group() if self.dp_size > 1 else None
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        # expert parallelism: a rank's routed experts are its own; their gradients are summed over the
        # ranks holding the same experts (expert DP), their norms over the ranks holding the others
        self.expert_dp_rank = ps.get_expert_data_parallel_rank()
        self.ep_rank = ps.get_expert_model_parallel_rank() if self.ep > 1 else 0
        self.expert_dp_group = ps.get_expert_data_parallel_group() if self.ep > 1 else None
        self.expert_groups = DP.ExpertGroups.current() if self.ep > 1 else None

    def _training(self, model):
        """(the model to train, its optimizer): Megatron DDP + Megatron's optimizer, or (the fp32 CPU
        default) the model itself + torch AdamW with this module's DP reduce and clip."""
        t = self.cfg
        if self.megatron_optimizer:
            return build_training(model, lr=t.lr, weight_decay=t.weight_decay, clip_grad=t.clip_grad, bf16=self.bf16,
                                  distributed_optimizer=t.use_distributed_optimizer)
        params = [p for p in model.parameters() if p.requires_grad]
        return model, torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.999), eps=1e-8)

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.model = self.ref_model = self.optimizer = None

    # ------------------------------------------------------------------ training

    def train_step(self, step: int, groups: list[Group]) -> dict[str, float]:
        """One rollout's training over `groups` (every rank given the whole rollout: this rank cuts its own
        part, miles_core.rank_batches); see `train_part`."""
        layout = DataLayout(self.dp_size, self.tp)
        parts = split_rollout(groups, layout, optimizer_steps=self.optimizer_steps, balance=self.cfg.balance_data,
                              advantages=self.advantages)
        return self.train_part(step, parts[self.dp_rank])

    def train_part(self, step: int, part: RankBatch) -> dict[str, float]:
        """One rollout's training from this DP rank's part of it: one optimizer step per step of the part
        (--global-batch-size samples each, over every DP rank); returns the train/* metrics
        (docs/fully-async.md)."""
        if part.dp_rank != self.dp_rank:
            raise TrainError(f"data-parallel rank {self.dp_rank} was handed the part of DP rank {part.dp_rank}")
        t0 = time.perf_counter()
        self.model.train()
        sums: dict[str, float] = {}
        if self.advantages.kl_in_reward:
            with trace.span("kl-in-reward", lane="train"):
                part, sums[N.REWARD_KL] = self._kl_in_reward(part)
        total_tokens, grad_norms, layout = 0.0, [], packing.LayoutCounts()
        for optimizer_step in part.steps:
            step_sums, grad_norm = self._optimizer_step_on(optimizer_step, layout)
            for k, v in step_sums.items():
                sums[k] = sums.get(k, 0.0) + v
            total_tokens += optimizer_step.tokens
            grad_norms.append(grad_norm)
        with trace.span("metrics", lane="train"):
            if self.dp_size > 1:  # every rank reduces the same keys, also one that got no samples
                sums = DP.all_reduce_sums({k: sums.get(k, 0.0) for k in self._sum_keys()}, self.dp_group)
            routing = self._routing_metrics(sums)
            metrics = finalize_metrics(sums, total_tokens) if part.samples else {}
            metrics.update(routing)
        metrics[N.GRAD_NORM] = sum(grad_norms) / max(len(grad_norms), 1)
        metrics[N.OPTIMIZER_STEPS] = float(len(grad_norms))
        metrics[N.TRAIN_SAMPLES] = float(part.samples)
        metrics[N.TRAIN_TOKENS] = total_tokens
        metrics[N.MICRO_BATCHES] = float(layout.micro_batches)
        metrics[N.PADDING_FRACTION] = layout.padding_fraction
        metrics[N.TRAIN_STEP_SECONDS] = time.perf_counter() - t0
        return metrics

    def _kl_in_reward(self, part: RankBatch) -> tuple[RankBatch, float]:
        """--kl-coef: this rank's part with each token's KL to the reference in its reward, the
        advantages finished (rank_batches.kl_reward_advantages, then whitened over every DP rank with
        --normalize-advantages); and the KL's sum over this rank's loss tokens. The KL is `approx_kl`
        of --kl-loss-type between the ratio's denominator policy (the trainer before the step, or the
        engine with --use-rollout-logprobs) and the reference; 0 on tokens outside the loss."""
        items = [item for step in part.steps for item in step.items]
        kls, kl_sum = self._token_kls(items, part.steps[0].first if part.steps else None)
        done = kl_reward_advantages(items, kls, self.advantages)
        if self.advantages.whiten:
            total, total_sq, count = whitening_sums(done)
            reduced = DP.all_reduce_sums({"count": count, "sq": total_sq, "sum": total}, self.dp_group)
            done = whiten_with(done, reduced["sum"], reduced["sq"], reduced["count"])
        left = iter(done)
        steps = [RankStep([next(left) for _ in step.items], step.tokens, step.first) for step in part.steps]
        return dataclasses.replace(part, steps=steps), kl_sum

    def _token_kls(self, items: list[tuple[Sample, float]], first) -> tuple[list[list[float]], float]:
        """Per sample, the KL to the reference of each response token (0 off the loss), and their sum."""
        use_rollout = self.loss_cfg.use_rollout_logprobs
        kls: list[list[float]] = []
        kl_sum = 0.0
        micros = self._micro_batches(items)
        idle = self._idle_micro_batches(len(micros))  # a forward is a collective under expert parallelism
        for micro in micros + ([[_idle(first)]] * idle if idle else []):
            batch, row, routes, replay = self._forward_inputs(micro, use_rollout)
            with torch.no_grad():
                with self._replaying(self.model, routes, **replay):
                    old = (batch["rollout_logp"] if use_rollout
                           else masked_token_logprobs(self.model, batch["tokens"], batch["mask"], **row)[0])
                with self._replaying(self.ref_model, routes, **replay):
                    ref, _ = masked_token_logprobs(self.ref_model, batch["tokens"], batch["mask"], **row)
            if len(kls) >= len(items):
                continue  # an idle micro-batch
            mask = batch["mask"].to(old.dtype)
            kl = approx_kl(old, ref, self.cfg.kl_loss_type) * mask
            kl_sum += float(kl.sum())
            resp, sizes = response_positions(batch["segments"])
            kls.extend(chunk.tolist() for chunk in torch.split(kl.flatten()[resp].float().cpu(), sizes))
        return kls, kl_sum

    def _optimizer_step_on(self, part: RankStep, layout: packing.LayoutCounts | None = None,
                           ) -> tuple[dict[str, float], float]:
        """One optimizer step on this rank's share `part` of the global batch: (this rank's metric sums,
        grad norm). The loss is normalised by the global batch's tokens. `layout` counts this rank's
        micro-batches and their padding."""
        self._zero_grad()
        total_tokens, mine = part.tokens, part.items
        sums: dict[str, float] = {}
        micros = self._micro_batches(mine)
        idle = self._idle_micro_batches(len(micros))  # agreed before any forward: each is a collective under EP
        with trace.span("forward+backward", lane="train", samples=len(mine)):
            for micro in micros:
                _, sample_sums = self._micro_batch(micro, total_tokens, layout)
                for k, v in sample_sums.items():
                    sums[k] = sums.get(k, 0.0) + v
            for _ in range(idle):
                self._micro_batch([_idle(part.first)], total_tokens)
        # nothing to learn from (every token masked out): no step, so weight decay does not move weights
        with trace.span("optimizer", lane="train"):
            grad_norm = self._optimizer_step() if total_tokens > 0 else 0.0
        return sums, grad_norm

    def _idle_micro_batches(self, mine: int) -> int:
        """How many micro-batches with nothing to learn this rank runs after its `mine`: under expert
        parallelism every forward and backward is a collective over the EP group (the token
        dispatch's all-to-all), so every DP rank runs as many as the one with the most."""
        if self.ep == 1 or self.dp_group is None:
            return 0
        most = torch.tensor([mine], dtype=torch.int64)
        collectives.all_reduce(most, self.dp_group, op=torch.distributed.ReduceOp.MAX)
        return int(most) - mine

    def _micro_batches(self, mine: list[tuple[Sample, float]]) -> list[list[tuple[Sample, float]]]:
        """This rank's samples cut into micro-batches: by the token budget (--use-dynamic-batch-size,
        miles_core.train.packing), else --micro-batch-size samples at a time."""
        if self.cfg.use_dynamic_batch_size:
            plan = packing.plan_micro_batches([_length(s) for s, _ in mine], self.cfg.max_tokens_per_gpu)
            return [[mine[i] for i in micro] for micro in plan]
        mbs = self.cfg.micro_batch_size
        return [mine[start:start + mbs] for start in range(0, len(mine), mbs)]

    def _micro_batch(self, items: list[tuple[Sample, float]], total_tokens: float,
                     layout: packing.LayoutCounts | None = None):
        # the output layer runs only where the loss mask is non-zero (0 elsewhere): no full-vocab logits
        batch, row, routes, replay = self._forward_inputs(items, self.loss_cfg.needs_rollout_logprobs)
        if layout is not None:
            layout.add(batch["tokens"].numel(), sum(_length(s) for s, _ in items))
        with self._replaying(self.model, routes, **replay) as seen:
            logp, entropy = masked_token_logprobs(self.model, batch["tokens"], batch["mask"], **row)
        if not self.loss_cfg.entropy_coef:
            entropy = entropy.detach()
        ref_logp = None
        if self.ref_model is not None:
            with torch.no_grad(), self._replaying(self.ref_model, routes, **replay):
                ref_logp, _ = masked_token_logprobs(self.ref_model, batch["tokens"], batch["mask"], **row)
        loss, sums = policy_loss(self.loss_cfg, logp, batch["advantages"], batch["mask"], total_tokens=total_tokens,
                                 rollout_logp=batch.get("rollout_logp"), ref_logp=ref_logp, entropy=entropy,
                                 segments=batch["segments"])
        if routes is not None:
            sums.update(_routing_sums(seen))
        aux_tokens = self._weigh_moe_aux_loss(batch["mask"], total_tokens)
        loss.backward()
        if aux_tokens is not None:  # read after the backward: under full recompute the routers run in it
            sums[N.MOE_AUX_LOSS] = moe_aux_loss_value(self.model) * aux_tokens
        return loss, sums

    def _forward_inputs(self, items, need_rollout: bool) -> tuple[dict, dict, torch.Tensor | None, dict]:
        """A micro-batch's packed tensors, the packed row's position ids and attention mask, the engine's
        routes and how to replay them (--use-rollout-routing-replay: the routers take the engine's
        routes; without it they are only compared)."""
        pack = _pack_row if self.cfg.use_dynamic_batch_size else _pack
        batch = pack(items, need_rollout, self.device)
        row = {"position_ids": batch.get("position_ids"), "attention_mask": batch.get("attention_mask")}
        routes, sequence = self._routes(items, batch["tokens"])
        return batch, row, routes, dict(replay=self.cfg.use_rollout_routing_replay, sequence_slice=sequence)

    def _routes(self, items, tokens: torch.Tensor) -> tuple[torch.Tensor | None, slice | None]:
        """(the micro-batch's engine routes [b, s, MoE layers, k], this TP rank's slice of the sequence
        under --sequence-parallel): None when no sample carries routes (a dense model, no replay).
        Right-padded rows: sample j on row j from position 0; a packed row: one after the other. Under
        sequence parallelism the sequence is padded to a multiple of the TP size (megatron_model.
        sequence_parallel_padding) and each TP rank's routers see their contiguous slice of it."""
        if not self.spec.moe:
            return None, None
        lengths = [_length(s) for s, _ in items]
        if self.cfg.use_dynamic_batch_size:
            starts = [sum(lengths[:j]) for j in range(len(lengths))]
            rows = [(0, start, n) for start, n in zip(starts, lengths)]
        else:
            rows = [(j, 0, n) for j, n in enumerate(lengths)]
        b, length = tokens.shape
        sequence = None
        if self.cfg.sequence_parallel:
            length += -length % self.tp
            part = length // self.tp
            sequence = slice(self.tp_rank * part, (self.tp_rank + 1) * part)
        routes = batch_routes([s for s, _ in items], self.spec, rows, (b, length))
        return routes, sequence if routes is not None else None

    @staticmethod
    def _replaying(model, routes: torch.Tensor | None, **replay):
        """`routing_replay.replaying` when the micro-batch has routes; else the plain forward (no hooks)."""
        return replaying(model, routes, **replay) if routes is not None else contextlib.nullcontext()

    def _routing_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """The routing-mismatch shares (N.ROUTING_MISMATCH, N.ROUTING_MISMATCH_OWN) from the step's sums
        (taken out of `sums`): under sequence parallelism each TP rank compared its slice of the
        sequence, so the counts add over TP too. Empty for a dense model or when no sample carried routes."""
        if not self.spec.moe:
            return {}
        keys = (N.ROUTING_DIFFER, N.ROUTING_DIFFER_OWN, N.ROUTING_COMPARED)
        counts = torch.tensor([sums.pop(k, 0.0) for k in keys], dtype=torch.float64)
        if self.cfg.sequence_parallel and self.tp_group is not None:
            collectives.all_reduce(counts, self.tp_group)
        differ, own, compared = counts.tolist()
        if not compared:
            return {}
        return {N.ROUTING_MISMATCH: differ / compared, N.ROUTING_MISMATCH_OWN: own / compared}

    def _weigh_moe_aux_loss(self, mask: torch.Tensor, total_tokens: float) -> float | None:
        """Before a micro-batch's backward, a MoE model's load-balancing loss gets the micro-batch's
        share of the batch's loss tokens as its weight, as the policy loss weighs its tokens
        (megatron_model.scale_moe_aux_loss); returns those tokens (None: the model adds no aux loss),
        which weigh its value in train/moe_aux_loss the same way."""
        if not has_moe_aux_loss(self.model):
            return None
        tokens = float(mask.sum())
        scale_moe_aux_loss(tokens / max(total_tokens, 1.0))
        return tokens

    def _sum_keys(self) -> tuple[str, ...]:
        """The metric sums every DP rank reduces (the loss's, and the aux loss of a MoE model that has one)."""
        routing = (N.ROUTING_DIFFER, N.ROUTING_DIFFER_OWN, N.ROUTING_COMPARED) if self.spec.moe else ()
        return (sum_keys(self.loss_cfg) + ((N.MOE_AUX_LOSS,) if has_moe_aux_loss(self.model) else ()) + routing
                + ((N.REWARD_KL,) if self.advantages.kl_in_reward else ()))

    def _zero_grad(self) -> None:
        if self.megatron_optimizer:
            with megatron_on_cpu():
                self.model.zero_grad_buffer()
                self.optimizer.zero_grad()
            return
        self.optimizer.zero_grad()

    def _optimizer_step(self) -> float:
        if self.megatron_optimizer:
            with megatron_on_cpu():  # DP reduce (reduce-scatter with the distributed optimizer), SP norms
                finalize_model_grads([self.model])
                _, grad_norm, _ = self.optimizer.step()
            return float(grad_norm or 0.0)
        DP.all_reduce_sequence_parallel_grads(self._params(), self.tp_group)  # norms' partial sums, first
        dense, experts = DP.split_expert_params(self._params())
        DP.all_reduce_grads(dense, self.dp_group)
        DP.all_reduce_grads(experts, self.expert_dp_group)
        grad_norm = DP.clip_grad_norm(self._params(), self.cfg.clip_grad, self.tp_group, self.expert_groups)
        self.optimizer.step()
        return grad_norm

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Trainer log-probs of each sample's response tokens (for tests and diagnostics)."""
        self.model.eval()
        batch = _pack([(s, 0.0) for s in samples], False, self.device, use_loss_mask=False)
        logp, _ = masked_token_logprobs(self.model, batch["tokens"], batch["mask"])
        return [logp[i][batch["mask"][i] > 0].tolist() for i in range(len(samples))]

    # ------------------------------------------------------------------ weights and state

    def hf_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Current weights as HF tensors (CPU, contiguous), optionally cast.

        Without a cast, on CPU, some tensors are views of the live parameters: use them before the
        next `train_step` (export and weight sync do), or clone them.
        """
        local = hf_convert.megatron_state(unwrap(self.model))
        full = hf_convert.gather_ep_state(self.spec, hf_convert.gather_tp_state(self.spec, local))
        state = hf_convert.megatron_to_hf(self.spec, full)
        return {k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in state.items()}

    @property
    def exports_with_peers(self) -> bool:
        """Whether rank 0 needs other ranks to export the weights: the TP shards and, under expert
        parallelism, the other EP ranks' experts are gathered (collectives they join: `join_export`)."""
        return self.tp > 1 or self.ep > 1

    @property
    def export_writer(self) -> tuple[int, int] | None:
        """(this rank's part, the parts) when it writes a part of an exported snapshot, else None. The
        writers are the ranks that hold the whole model once gathered: with peers (TP or EP) the ranks of
        expert-DP rank 0 (one per TP x EP slice, part ep_rank x TP + tp_rank), else every data-parallel
        rank, each a replica (part dp_rank). Rank 0 writes part 0."""
        if self.exports_with_peers:
            if self.expert_dp_rank != 0:
                return None
            return self.ep_rank * self.tp + self.tp_rank, self.tp * self.ep
        return self.dp_rank, self.dp_size

    def join_export(self) -> None:
        """What a rank other than the export source does while rank 0 exports: the ranks holding one
        copy of every expert with rank 0 (expert-DP rank 0: rank 0's TP and EP peers and their TP
        peers; without EP, DP rank 0) take part in gathering the shards and the experts; every other
        rank has nothing to do."""
        if self.expert_dp_rank == 0 and self.exports_with_peers:
            self.hf_state_dict()

    def export_hf(self, out_dir: str) -> str:
        """HF checkpoint of the current weights: model.safetensors, config.json, tokenizer files."""
        os.makedirs(out_dir, exist_ok=True)
        save_file(self.hf_state_dict(), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        for name, data in self.aux_files.items():
            with open(os.path.join(out_dir, name), "wb") as f:
                f.write(data)
        return out_dir

    def checkpoint_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
        """({"model": tensors, "optimizer": tensors, "rng": tensors}, JSON meta) for checkpoint.py.

        These are this rank's TP shards (under expert parallelism: with its own experts, numbered from
        0). DP rank 0 of each TP rank holds the whole optimizer state: replicated over DP ranks (AdamW,
        Megatron's non-distributed optimizer), or gathered onto it (the distributed optimizer: a
        collective, so every rank calls this; optimizer_state.py); under EP, expert-DP rank 0 of each
        TP and EP rank (its experts' state is replicated over expert DP). A checkpoint resumes at any
        DP size.
        """
        model = hf_convert.megatron_state(unwrap(self.model))
        opt_tensors, opt_skeleton = optimizer_state(self.optimizer)
        rng = {"torch_cpu": torch.get_rng_state()}
        if self.cuda:
            rng["torch_cuda"] = torch.cuda.get_rng_state()
        meta = {"optimizer": opt_skeleton, "python_random": _jsonable(random.getstate()),
                "spec": _spec_json(self.spec), "tensor_model_parallel_size": self.tp,
                "expert_model_parallel_size": self.ep}
        return {"model": model, "optimizer": opt_tensors, "rng": rng}, meta

    def load_checkpoint_state(self, tensors: dict[str, dict[str, torch.Tensor]], meta: dict) -> None:
        self.load_model_state(tensors["model"], meta)
        load_optimizer_state(self.optimizer, tensors["optimizer"], meta["optimizer"])
        if self.cuda:
            torch.cuda.set_rng_state(tensors["rng"]["torch_cuda"])
        torch.set_rng_state(tensors["rng"]["torch_cpu"])
        random.setstate(_python_rng(meta["python_random"]))

    def load_model_state(self, model: dict[str, torch.Tensor], meta: dict, *, reference: bool = False) -> None:
        """This rank's Megatron weights from a checkpoint (`reference`: also into the KL reference)."""
        saved_tp = int(meta.get("tensor_model_parallel_size", 1))
        if saved_tp != self.tp:
            raise TrainError(f"checkpoint was saved with --tensor-model-parallel-size={saved_tp}; this trainer has "
                             f"{self.tp}. Resuming at another TP size is not supported (the DP size may change).")
        saved_ep = int(meta.get("expert_model_parallel_size", 1))
        if saved_ep != self.ep:
            raise TrainError(f"checkpoint was saved with --expert-model-parallel-size={saved_ep}; this trainer has "
                             f"{self.ep}. Resuming at another EP size is not supported (each EP rank's file holds "
                             "its own experts; the DP size may change).")
        own = hf_convert.model_tensors(unwrap(self.model))
        if set(own) != set(model) or meta.get("spec") != _spec_json(self.spec):
            raise TrainError(f"checkpoint is for another model ({meta.get('spec')}); this trainer has {self.spec}")
        ref = [hf_convert.model_tensors(unwrap(self.ref_model))] if reference and self.ref_model is not None else []
        targets = [own] + ref
        with torch.no_grad():
            for target in targets:
                for k in own:
                    target[k].copy_(model[k])
        self._weights_changed()

    def load_hf_weights(self, hf_dir: str) -> None:
        """Initial weights (and the KL reference) from another HF directory of the same architecture."""
        spec = ModelSpec.from_hf_config(hf_convert.read_hf_config(hf_dir))
        if spec != self.spec:
            raise TrainError(f"{hf_dir} holds another model ({spec}); --hf-checkpoint is {self.spec}")
        models = [unwrap(m) for m in (self.model, self.ref_model) if m is not None]
        hf_shards.load_hf_checkpoint(models, self.spec, hf_dir)  # this TP rank's shards, read once
        self._weights_changed()

    def _weights_changed(self) -> None:
        """After weights were loaded into the model: Megatron's optimizer keeps fp32 main weights
        (bf16, or the distributed optimizer's shards) that would otherwise write the old ones back."""
        if self.megatron_optimizer:
            with megatron_on_cpu():
                self.optimizer.reload_model_params()


def non_weight_files(src_dir: str) -> dict[str, bytes]:
    """config.json, generation config and tokenizer files of the source checkpoint, by name."""
    out = {}
    for name in sorted(os.listdir(src_dir)):
        path = os.path.join(src_dir, name)
        if os.path.isfile(path) and not name.endswith(WEIGHT_FILES) and not name.startswith("."):
            with open(path, "rb") as f:
                out[name] = f.read()
    return out


def _idle(item: tuple[Sample, float]) -> tuple[Sample, float]:
    """`item` with nothing to learn (its loss mask all 0): the forward and backward of an idle micro-batch."""
    s = item[0]
    return dataclasses.replace(s, loss_mask=[0] * len(s.response_ids)), 0.0


def _routing_sums(seen: Seen) -> dict[str, float]:
    """One forward's routing counts: (token, MoE layer) pairs compared with the engine's routes, and
    those whose top-k differed in the routing used and in the routers' own choice."""
    differ, compared = seen.mismatch("used")
    own, _ = seen.mismatch("own")
    return {N.ROUTING_DIFFER: differ, N.ROUTING_DIFFER_OWN: own, N.ROUTING_COMPARED: compared}


def _pack(items, need_rollout: bool, device, use_loss_mask: bool = True) -> dict[str, torch.Tensor]:
    """Right-padded [b, L] tokens; targets/mask/advantages/rollout log-probs on [b, L-1]."""
    tokens, targets = _sample_tensors(items, need_rollout, use_loss_mask)
    L = max(t.numel() for t in tokens)
    out = {"tokens": _right_pad(tokens, L)}
    for key in targets[0]:
        out[key] = _right_pad([t[key] for t in targets], L - 1)
    out["targets"] = out["tokens"][:, 1:]
    return {k: v.to(device) for k, v in out.items()}


def _pack_row(items, need_rollout: bool, device, use_loss_mask: bool = True) -> dict[str, torch.Tensor]:
    """The samples back to back in one row [1, T], no padding (miles_core.train.packing): what
    `_pack` gives, plus the row's "position_ids" and block-diagonal "attention_mask"."""
    tokens, targets = _sample_tensors(items, need_rollout, use_loss_mask)
    out = packing.pack_rows(tokens, targets, device)
    out["targets"] = out["tokens"][:, 1:]
    return out


def _sample_tensors(items, need_rollout: bool, use_loss_mask: bool) -> tuple[list[torch.Tensor], list[dict]]:
    """Per sample: its tokens [n], and its "mask", "advantages" (and "rollout_logp") on its n - 1
    target positions, 0 where a prompt token is predicted."""
    # rollout log-probs go along whenever every sample has them: the loss may not need them, but
    # train/train_rollout_logprob_abs_diff is worth having on-policy too
    need_rollout = need_rollout or all(len(s.response_logprobs) == len(s.response_ids) for s, _ in items)
    tokens, targets = [], []
    for s, a in items:
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens.append(torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long))
        mask = _loss_mask(s) if use_loss_mask else [1] * r
        per_token = [float(a)] * r if isinstance(a, (int, float)) else list(a)
        row = {"mask": _on_targets(p, mask), "advantages": _on_targets(p, per_token),
               "segments": _on_targets(p, [float(len(tokens))] * r)}  # the sample's number (from 1), for gspo
        if need_rollout:
            row["rollout_logp"] = _on_targets(p, _rollout_logprobs(s))
        targets.append(row)
    return tokens, targets


def _rollout_logprobs(s: Sample) -> list[float]:
    if len(s.response_logprobs) != len(s.response_ids):
        raise TrainError(f"sample {s.group_id}/{s.sample_index}: {len(s.response_logprobs)} rollout log-probs for "
                         f"{len(s.response_ids)} response tokens; the loss needs the engine's log-prob of every token")
    return list(s.response_logprobs)


def _on_targets(prompt_len: int, values: list) -> torch.Tensor:
    """A response's per-token `values` on its sample's target positions (fp32): 0 for the prompt's."""
    return torch.cat([torch.zeros(prompt_len - 1), torch.tensor(values, dtype=torch.float32)])


def _right_pad(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    out = rows[0].new_zeros(len(rows), length)
    for i, row in enumerate(rows):
        out[i, :row.numel()] = row
    return out


def _spec_json(spec: ModelSpec) -> dict:
    """The spec as trainer.json stores it (JSON: tuples become lists), for comparing with a saved one."""
    return json.loads(json.dumps(dataclasses.asdict(spec)))


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _python_rng(x):
    return tuple(_python_rng(v) if isinstance(v, list) else v for v in x)

