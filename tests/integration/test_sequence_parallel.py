"""Megatron sequence parallelism in the CPU trainer (--sequence-parallel): the real Trainer at TP=2 on
two processes (torch.distributed over gloo, under the strict device harness), with and without it,
and at TP=1, on a Llama (RMSNorm, RoPE, GQA, untied), a GPT-2 (LayerNorm with biases, biases in
the row-parallel linears, learned positions, tied) and a Qwen3 (q/k norms over each head: each TP
rank holds half the heads, so their gradients are partial sums even without sequence parallelism);
lr=0, so every gradient is taken at the same weights.

Pins: after one `train_step` (micro-batches of 3 samples, lengths 6 to 11 tokens, odd ones
included, so the padding to a multiple of TP runs), TP=2 with --sequence-parallel (also with full
recompute on top) gives the loss, the grad norm and every parameter's gradient (the TP shards
gathered) of TP=2 without it and of TP=1, and the same eval log-probs (`Trainer.logprobs`); every
norm weight and bias and every row-parallel bias is marked `sequence_parallel` and ends with the
same gradient on both TP ranks.

Guards: the norms' partial gradients not summed over TP (each rank's slice of the sequence only:
`data_parallel.all_reduce_sequence_parallel_grads` skipped), the gathered hidden states' gradient
reduce-scattered on top of token_logprobs' all-reduce (TP x every gradient below the final norm),
a micro-batch of odd length not padded (Megatron's split refuses it), the flag not reaching the
model (the worker checks the built config), and any collective of ours handed a CPU tensor where
NCCL would refuse it.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from tests.support.ranks import exit_launcher, fork_ranks, run_launcher
from tests.support import strict_device as strict

TP_RANKS_SECONDS = 240  # the tensor-parallel ranks, forked, to their end

TP = 2
RTOL, ATOL = 1e-5, 1e-6  # fp32 on CPU; the layouts differ only in the order of summation
PROMPT = 5
RESPONSES = (1, 6, 2, 5, 3, 4, 6, 1)  # micro-batches of 3: max lengths 11, 10, 11 (odd and even)
VARIANTS = {
    "tp2": {},
    "tp2-sp": {"sequence_parallel": True},
    "tp2-sp-recompute": {"sequence_parallel": True, "recompute_granularity": "full", "recompute_method": "uniform",
                         "recompute_num_layers": 1},
}


def _groups():
    from miles_core.samples import Group, Sample, SampleStatus

    groups = []
    for g in range(2):
        prompt = [(3 * g + i) % 10 for i in range(PROMPT - 1)] + [10]
        samples = []
        for i, r in enumerate(RESPONSES[4 * g:4 * g + 4]):
            resp = [(7 * i + j + g) % 16 for j in range(r)]
            samples.append(Sample(f"g{g}", g, i, prompt, resp, [-2.5] * r, [1] * r, [1] * r,
                                  reward=float((i * 5 + g) % 4), status=SampleStatus.COMPLETED))
        groups.append(Group(f"g{g}", g, samples))
    return groups


def _write_models(tmp: str) -> dict[str, str]:
    """Two tiny HF checkpoints whose vocabulary, heads and FFN divide by 2 (TP=2)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    llama = LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        tie_word_embeddings=False)
    gpt = GPT2Config(vocab_size=16, n_positions=64, n_embd=64, n_layer=2, n_head=4, activation_function="gelu_new",
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    qwen3 = Qwen3Config(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
    out = {}
    for name, cls, cfg in (("llama", LlamaForCausalLM, llama), ("gpt2", GPT2LMHeadModel, gpt),
                           ("qwen3", Qwen3ForCausalLM, qwen3)):
        torch.manual_seed(3)
        model = cls(cfg)
        with torch.no_grad():  # norms away from their init (ones, zeros), so their gradients differ by rank
            for n, p in model.named_parameters():
                if "norm" in n or "ln_" in n:
                    p.add_(torch.randn_like(p) * 0.2)
        out[name] = os.path.join(tmp, name)
        model.save_pretrained(out[name], safe_serialization=True)
    return out


def _run(hf_dir: str, tp: int, **flags) -> dict:
    """One train_step and the eval log-probs of a Trainer; gradients gathered over TP."""
    from miles_core.config.sections import TrainSection
    from miles_core.train.hf_convert import gather_tp_state
    from miles_core.train.megatron_model import unwrap
    from miles_core.train.trainer import Trainer

    cfg = dataclasses.replace(TrainSection(), lr=0.0, clip_grad=1e9, micro_batch_size=3,
                              tensor_model_parallel_size=tp, **flags)
    with Trainer(cfg, hf_dir) as tr:
        assert unwrap(tr.model).config.sequence_parallel == flags.get("sequence_parallel", False)
        metrics = tr.train_step(0, _groups())
        local = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters()}
        marked = sorted(n for n, p in tr.model.named_parameters() if getattr(p, "sequence_parallel", False))
        out = {"metrics": metrics, "grads": gather_tp_state(tr.spec, local), "marked": marked,
               "logprobs": tr.logprobs([s for g in _groups() for s in g.samples])}
    return out


def _worker(rank: int, models: dict[str, str], tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=TP)
    from miles_core.train import collectives

    out = {}
    for name, hf_dir in models.items():
        for variant, flags in VARIANTS.items():
            out[name, variant] = _run(hf_dir, TP, **flags)
    assert collectives.standing_device(None) == "cuda"  # the groups stood for NCCL
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _launch(tmp: str) -> None:
    """In a fresh (spawned) process: import Megatron and write the checkpoints once, fork the two TP
    ranks (no process group exists before the fork), then, once they are done, the TP=1 reference in
    this process. Exits without interpreter teardown."""
    torch.set_num_threads(1)
    import megatron.core.models.gpt  # noqa: F401

    import miles_core.train.trainer  # noqa: F401

    models = _write_models(tmp)
    os.environ.update(strict.ENV)  # NCCL's device rule on the ranks' gloo groups
    fork_ranks(_worker, [(r, models, tmp) for r in range(TP)], timeout=TP_RANKS_SECONDS)
    torch.save({name: _run(hf_dir, 1) for name, hf_dir in models.items()}, os.path.join(tmp, "tp1.pt"))
    exit_launcher(0)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sp")
    run_launcher(_launch, str(tmp), 300, "the TP=2 trainer processes")
    return [torch.load(tmp / f"rank{r}.pt") for r in range(TP)], torch.load(tmp / "tp1.pt")


def test_the_batch_has_odd_and_even_micro_batches():
    lengths = [PROMPT + r for r in RESPONSES]
    longest = [max(lengths[i:i + 3]) for i in range(0, len(lengths), 3)]
    assert {n % TP for n in longest} == {0, 1}, longest


@pytest.mark.parametrize("model", ["llama", "gpt2", "qwen3"])
@pytest.mark.parametrize("variant", ["tp2-sp", "tp2-sp-recompute"])
def test_sequence_parallel_makes_the_tp2_and_tp1_step(results, model, variant):
    """Pins loss, grad norm, every gathered gradient and the eval log-probs of TP=2 with
    --sequence-parallel against TP=2 without it and TP=1 (see the module docstring)."""
    ranks, tp1 = results
    one = tp1[model]
    for r, saved in enumerate(ranks):
        sp, plain = saved[model, variant], saved[model, "tp2"]
        off = max(float((sp["grads"][k] - g).abs().max()) for k, g in one["grads"].items())
        for key in ("train/loss", "train/grad_norm"):
            print(f"{model} {variant} rank {r}: {key} {sp['metrics'][key]:.8g} (TP=2 {plain['metrics'][key]:.8g}, "
                  f"TP=1 {one['metrics'][key]:.8g})")
        print(f"{model} {variant} rank {r}: max |gradient - TP=1 gradient| {off:.2e}")
        for ref in (plain, one):
            for key in ("train/loss", "train/grad_norm", "train/tokens"):
                assert sp["metrics"][key] == pytest.approx(ref["metrics"][key], rel=RTOL), key
            assert set(sp["grads"]) == set(ref["grads"])
            for name, g in ref["grads"].items():
                torch.testing.assert_close(sp["grads"][name], g, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
            for a, b in zip(sp["logprobs"], ref["logprobs"]):
                assert a == pytest.approx(b, rel=RTOL, abs=ATOL)


@pytest.mark.parametrize("model", ["llama", "gpt2", "qwen3"])
def test_norm_gradients_are_marked_and_the_same_on_both_tp_ranks(results, model):
    """Megatron's `sequence_parallel` marks (norms; GPT-2's row-parallel biases too) are on every
    parameter whose gradient is a partial sum per rank, and the sum leaves both ranks the same."""
    ranks, _ = results
    marked = ranks[0][model, "tp2-sp"]["marked"]
    norms = [n for n in ranks[0][model, "tp2-sp"]["grads"] if "layernorm" in n]
    assert norms and set(norms) <= set(marked)
    if model == "gpt2":
        row_parallel_biases = {f"decoder.layers.0.{n}.bias" for n in ("self_attention.linear_proj", "mlp.linear_fc2")}
        assert row_parallel_biases <= set(marked)
    # without the flag only the q/k norms are marked: each TP rank's heads give part of their gradient
    qk = sorted(n for n in norms if "q_layernorm" in n or "k_layernorm" in n)
    assert bool(qk) == (model == "qwen3")
    assert ranks[0][model, "tp2"]["marked"] == qk
    for variant, names in (("tp2-sp", marked), ("tp2", qk)):
        first, second = ranks[0][model, variant]["grads"], ranks[1][model, variant]["grads"]
        for name in names:
            torch.testing.assert_close(first[name], second[name], rtol=0, atol=0)
