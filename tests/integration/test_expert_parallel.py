"""Expert parallelism in the CPU trainer: the real Trainer on real process groups (torch.distributed over
gloo, Megatron's parallel state, the strict device harness), on tiny random Qwen3-MoE and GLM-4.5
checkpoints built with transformers' own classes.

Pins:
- EP=2 (two ranks, DP=2): each rank loads only its two (GLM: four) experts, numbered from 0 in its
  model, equal to the checkpoint's experts 2r, 2r+1 (4r..4r+3); the exported HF state (rank 0, the
  other rank joining the gather) is bit-identical to the checkpoint; a checkpoint saves one file per
  EP rank (`.ep00`, `.ep01`) and restores each rank's own experts;
- TP=2 x EP=2 (four ranks, with --sequence-parallel): the same bit-exact export;
- DP=2 x EP=2 gradients of one train_step (lr 0, aux loss off, micro-batches of 3) equal those of
  DP=1 x EP=1 on the same batch, dense and every expert (gathered by global number), to fp32
  summation order; the loss metrics too. The batch's 7 samples give the DP ranks 2 and 1
  micro-batches: the second runs an idle one (every forward is an all-to-all over the EP group);
- the same EP=2 step on Megatron's DDP and optimizer (--bf16, the GPU trainer's path) has the fp32
  gradient norm to bf16 precision, and its checkpoint restores;
- under strict mode the EP group stands for NCCL: a CPU tensor handed to `all_to_all_single` on it is
  refused, while the train step's own all-to-all (Megatron's dispatch, dtype-checked) runs.

Guards: expert gradients summed over the DP group (which would double them), a rank with fewer
micro-batches leaving its EP peer waiting in the dispatch's all-to-all, an export that writes
rank 0's experts under every EP rank's numbers (or only rank 0's), a checkpoint that writes one file
for all EP ranks (the second rank's experts lost), the EP group missing from strict mode.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles_core.metrics import names as N
from tests.support.ranks import exit_launcher, fork_ranks, run_launcher
from tests.support import strict_device as strict

EP_RANKS_SECONDS = 600  # up to four forked ranks building and stepping MoE models on gloo

RTOL, ATOL = 1e-5, 1e-6  # fp32 on CPU; the layouts differ only in the order of summation
PROMPT = 5
RESPONSES = (1, 6, 2, 5, 3, 4, 6, 1)
MODELS = ("qwen3_moe", "glm4_moe")


def _groups():
    from miles_core.samples import Group, Sample, SampleStatus

    groups = []
    for g in range(2):
        prompt = [(3 * g + i) % 10 for i in range(PROMPT - 1)] + [10]
        samples = []
        for i, r in enumerate(RESPONSES[4 * g:4 * g + 4]):
            resp = [(7 * i + j + g) % 16 for j in range(r)]
            failed = g == 1 and i == 3  # 7 samples to train: DP ranks of 4 and 3, micro-batches 2 and 1
            samples.append(Sample(f"g{g}", g, i, prompt, resp, [-2.5] * r, [1] * r, [1] * r,
                                  reward=float((i * 5 + g) % 4),
                                  status=SampleStatus.FAILED if failed else SampleStatus.COMPLETED))
        groups.append(Group(f"g{g}", g, samples))
    return groups


def _write_models(tmp: str) -> dict[str, str]:
    """Tiny checkpoints whose vocabulary, heads and widths divide by 2 (TP=2) and experts by 2 (EP=2)."""
    from transformers import AutoModelForCausalLM, Glm4MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=16, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    configs = {
        "qwen3_moe": Qwen3MoeConfig(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                    router_aux_loss_coef=0.01, **common),
        "glm4_moe": Glm4MoeConfig(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=4, n_shared_experts=1,
                                  first_k_dense_replace=1, n_group=2, topk_group=2, routed_scaling_factor=2.5,
                                  **common),
    }
    out = {}
    for name, cfg in configs.items():
        torch.manual_seed(5)
        model = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # norms and GLM's expert bias away from their init, so a wrong mapping shows
            for n, t in [*model.named_parameters(), *model.named_buffers()]:
                if "norm" in n or "e_score_correction_bias" in n:
                    t.add_(torch.randn_like(t) * 0.2)
                elif "experts" in n or "mlp.gate.weight" in n:
                    t.mul_(8.0)  # experts and routers that matter against the residual stream
        out[name] = os.path.join(tmp, name)
        model.save_pretrained(out[name])
    return out


def _train(tp: int = 1, ep: int = 1, **flags):
    from miles_core.config.sections import TrainSection

    return dataclasses.replace(TrainSection(), lr=0.0, clip_grad=1e9, micro_batch_size=3, moe_aux_loss_coeff=0.0,
                               tensor_model_parallel_size=tp, expert_model_parallel_size=ep, **flags)


def _global_grads(tr) -> dict:
    """This rank's gradients by canonical name, its experts renamed to their global numbers."""
    from megatron.core import parallel_state as ps

    from miles_core.models.families.tensors import expert_of, with_expert

    per = tr.spec.num_experts // tr.ep
    out = {}
    for n, p in tr.model.named_parameters():
        e = expert_of(n)
        out[n if e is None else with_expert(n, ps.get_expert_model_parallel_rank() * per + e)] = p.grad.detach().clone()
    return out


def _checkpoint_round_trip(tr, root: str) -> dict:
    """Save, scramble the model, restore: the restored weights, and the files of the checkpoint."""
    from miles_core.storage import Store
    from miles_core.train.checkpoint import CheckpointManager, step_dir
    from miles_core.train.hf_convert import model_tensors
    from miles_core.train.megatron_model import unwrap

    manager = CheckpointManager(Store(root))
    before = {k: v.clone() for k, v in model_tensors(unwrap(tr.model)).items()}
    manager.save(0, tr)
    with torch.no_grad():
        for p in tr.model.parameters():
            p.zero_()
    manager.load(0, tr)
    after = model_tensors(unwrap(tr.model))
    files = sorted(os.listdir(os.path.join(root, step_dir(0))))
    return {"restored": all(torch.equal(before[k], after[k]) for k in before), "files": files}


def _ep2_rank(rank: int, models: dict[str, str], tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg2", rank=rank, world_size=2)
    from megatron.core import parallel_state as ps

    from miles_core.train import collectives
    from miles_core.train.hf_convert import megatron_state
    from miles_core.train.megatron_model import unwrap
    from miles_core.train.trainer import Trainer

    out = {}
    for name, hf_dir in models.items():
        with Trainer(_train(ep=2), hf_dir) as tr:
            out[name] = {"local": megatron_state(unwrap(tr.model)), "export": tr.hf_state_dict(),
                         "ep_rank": ps.get_expert_model_parallel_rank(), "dp_rank": tr.dp_rank}
            out[name]["metrics"] = tr.train_step(0, _groups())
            out[name]["grads"] = _global_grads(tr)
            out[name]["checkpoint"] = _checkpoint_round_trip(tr, os.path.join(tmp, f"ckpt-{name}"))
        with Trainer(_train(ep=2, bf16=True), hf_dir) as tr:  # the GPU trainer's path: Megatron's DDP and optimizer
            out[name]["bf16"] = {"metrics": tr.train_step(0, _groups()),
                                 "checkpoint": _checkpoint_round_trip(tr, os.path.join(tmp, f"ckpt-bf16-{name}"))}
    group = ps.get_expert_model_parallel_group()
    out["strict"] = collectives.standing_device(group)
    try:
        dist.all_to_all_single(torch.zeros(2), torch.ones(2), group=group)
        out["all_to_all_refused"] = ""
    except strict.DeviceRuleError as e:
        out["all_to_all_refused"] = str(e)
    torch.save(out, os.path.join(tmp, f"ep2-rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _tp2_ep2_rank(rank: int, models: dict[str, str], tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg4", rank=rank, world_size=4)
    from miles_core.train.trainer import Trainer

    out = {}
    for name, hf_dir in models.items():
        with Trainer(_train(tp=2, ep=2, sequence_parallel=True), hf_dir) as tr:
            out[name] = tr.hf_state_dict() if rank == 0 else tr.join_export()
    torch.save(out, os.path.join(tmp, f"tp2ep2-rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _one_rank(models: dict[str, str], tmp: str) -> None:
    from miles_core.train.trainer import Trainer

    out = {}
    for name, hf_dir in models.items():
        with Trainer(_train(), hf_dir) as tr:
            out[name] = {"metrics": tr.train_step(0, _groups()), "grads": _global_grads(tr)}
    torch.save(out, os.path.join(tmp, "ep1.pt"))


def _launch(tmp: str) -> None:
    """In a fresh (spawned) process: import Megatron and write the checkpoints once, fork the EP=2 ranks,
    then the TP=2 x EP=2 ranks (no process group exists before a fork), then the one-rank reference in
    this process. Exits without interpreter teardown."""
    torch.set_num_threads(1)
    import megatron.core.models.gpt  # noqa: F401

    import miles_core.train.trainer  # noqa: F401

    models = _write_models(tmp)
    os.environ.update(strict.ENV)  # NCCL's device rule on the ranks' gloo groups
    code = 0
    try:
        fork_ranks(_ep2_rank, [(r, models, tmp) for r in range(2)], timeout=EP_RANKS_SECONDS)
        fork_ranks(_tp2_ep2_rank, [(r, models, tmp) for r in range(4)], timeout=EP_RANKS_SECONDS)
        del os.environ[strict.RANK_SETUP_ENV]
        _one_rank(models, tmp)
    except Exception as e:  # noqa: BLE001 - reported through the exit code, the traceback on stderr
        import traceback

        traceback.print_exc()
        print(e, file=sys.stderr)
        code = 1
    exit_launcher(code)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep")
    run_launcher(_launch, str(tmp), 1200, "the expert-parallel trainer processes")
    load = lambda name: torch.load(tmp / name, weights_only=False)  # noqa: E731
    return {"tmp": tmp, "ep2": [load(f"ep2-rank{r}.pt") for r in range(2)],
            "tp2ep2": load("tp2ep2-rank0.pt"), "ep1": load("ep1.pt")}


def _checkpoint_state(tmp, name: str) -> dict:
    from miles_core.models.safetensors_dir import SafetensorsReader

    with SafetensorsReader(str(tmp / name)) as r:
        return {n: r.read(n).clone() for n in r.names()}


@pytest.mark.parametrize("name", MODELS)
def test_each_ep_rank_loads_only_its_experts(results, name):
    from miles_core.models.families.tensors import expert_of

    hf = _checkpoint_state(results["tmp"], name)
    for rank, got in enumerate(r[name] for r in results["ep2"]):
        assert got["ep_rank"] == got["dp_rank"] == rank
        experts = {expert_of(n) for n in got["local"]} - {None}
        per = len(experts)
        assert per * 2 == (4 if name == "qwen3_moe" else 8) and experts == set(range(per))
        layer = 1  # a MoE layer of both models
        for local in range(per):
            fc2 = got["local"][f"decoder.layers.{layer}.mlp.experts.local_experts.{local}.linear_fc2.weight"]
            assert torch.equal(fc2, hf[f"model.layers.{layer}.mlp.experts.{rank * per + local}.down_proj.weight"])


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("layout", ["ep2", "tp2ep2"])
def test_hf_to_megatron_to_hf_is_bit_exact_under_expert_parallelism(results, name, layout):
    hf = _checkpoint_state(results["tmp"], name)
    exported = results["ep2"][0][name]["export"] if layout == "ep2" else results["tp2ep2"][name]
    assert set(exported) == set(hf)
    assert [n for n in hf if not torch.equal(exported[n], hf[n])] == []


@pytest.mark.parametrize("name", MODELS)
def test_dp2_ep2_gradients_equal_dp1_ep1(results, name):
    one = results["ep1"][name]
    ranks = [r[name] for r in results["ep2"]]
    experts = {n for n in one["grads"] if ".mlp.experts." in n}
    assert len(experts) > 0
    worst = 0.0
    for n, want in one["grads"].items():
        owner = [r for r in ranks if n in r["grads"]]
        assert owner, f"{n}: no EP rank has its gradient"
        for r in owner:  # dense: every rank, after the DP reduce; an expert: its owner only
            torch.testing.assert_close(r["grads"][n], want, rtol=RTOL, atol=ATOL, msg=n)
            worst = max(worst, float((r["grads"][n] - want).abs().max()))
        assert len(owner) == (1 if n in experts else 2), n
    print(f"{name}: gradient max abs diff DP2xEP2 vs DP1xEP1 = {worst:.3g}")
    for key in ("train/loss", "train/entropy", "train/ppo_kl", "train/grad_norm"):
        assert ranks[0]["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7), key
    assert any(float(g.abs().sum()) > 0 for n, g in one["grads"].items() if n in experts)  # experts learn
    assert [r["metrics"][N.MICRO_BATCHES] for r in ranks] == [2, 1]  # rank 1 ran an idle one besides


@pytest.mark.parametrize("name", MODELS)
def test_checkpoints_hold_each_ep_ranks_experts(results, name):
    for r in results["ep2"]:
        assert r[name]["checkpoint"]["restored"]
    files = results["ep2"][0][name]["checkpoint"]["files"]
    assert {"model.ep00.safetensors", "model.ep01.safetensors", "optimizer.ep01.safetensors"} <= set(files), files


@pytest.mark.parametrize("name", MODELS)
def test_megatrons_ddp_and_optimizer_under_expert_parallelism(results, name):
    """The GPU trainer's path (--bf16 on CPU: Megatron's DDP reduces expert gradients over expert DP,
    its optimizer clips with the experts' norms over EP): the step's gradient norm is the fp32 DP=1 x
    EP=1 one to bf16 precision on both ranks, and the checkpoint (Megatron's optimizer state per EP rank)
    restores."""
    want = results["ep1"][name]["metrics"]["train/grad_norm"]
    for r in results["ep2"]:
        assert r[name]["bf16"]["metrics"]["train/grad_norm"] == pytest.approx(want, rel=2e-2)
        assert r[name]["bf16"]["checkpoint"]["restored"]


def test_strict_mode_refuses_a_cpu_tensor_in_all_to_all_on_the_ep_group(results):
    for r in results["ep2"]:
        assert r["strict"] == "cuda"
        assert "torch.distributed.all_to_all_single got a tensor on cpu" in r["all_to_all_refused"]
