"""The trainer's chunked, masked-positions log-probs (miles_core.train.token_logprobs) against the
naive full-vocabulary computation.

Pins: on tied (builtin:tiny-gpt, builtin:tiny-llama) and untied (a small Llama) models, with a chunk
of 3 tokens so several checkpointed chunks run, the log-probs, entropies, loss, metric sums and
every parameter gradient (entropy bonus and KL to a perturbed reference included) equal those of
full fp32 logits with log_softmax; `Trainer.logprobs` too; and no tensor with a vocabulary-sized
last dimension ever has more rows than one chunk, in forward or backward.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from miles_core.config.sections import TrainSection
from miles_core.models.builtin import materialize_checkpoint
from miles_core.train import token_logprobs as TL
from miles_core.train.losses import policy_loss, token_entropy
from miles_core.train.megatron_model import forward_logits, masked_token_logprobs, unwrap
from miles_core.rank_batches import trainable_samples
from miles_core.train.trainer import Trainer, _pack
from tests.unit.test_train import make_groups

torch.set_num_threads(1)

ATOL = 1e-5
CHUNK = 3
CFG = dataclasses.replace(TrainSection(), entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3")


@pytest.fixture(scope="module", params=["builtin:tiny-gpt", "builtin:tiny-llama", "untied-llama"])
def checkpoint(request, tmp_path_factory):
    out = str(tmp_path_factory.mktemp(request.param.replace(":", "-")))
    if request.param != "untied-llama":
        return materialize_checkpoint(request.param, 1, out)
    return _untied_llama(out)


def _untied_llama(out: str) -> str:
    """Untied output layer; vocabulary 50, a size no other dimension of the model or batch has."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(3)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out


def _items():
    groups = make_groups(3, 4, seed=5)
    s = groups[0].samples[1]
    s.loss_mask = [i % 2 for i in range(len(s.response_ids))]  # masked positions inside a response
    items = trainable_samples(groups, True)
    return items, float(sum(sum(s.loss_mask) for s, _ in items))


def _naive_micro_batch(tr: Trainer, items, total_tokens: float):
    """The trainer's former path: full [b, L-1, vocab] fp32 logits and log_softmax."""
    batch = _pack(items, tr.loss_cfg.needs_rollout_logprobs, tr.device)
    logits = forward_logits(tr.model, batch["tokens"])[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)
    entropy = token_entropy(logits)
    with torch.no_grad():
        ref = torch.log_softmax(forward_logits(tr.ref_model, batch["tokens"])[:, :-1].float(), -1)
        ref_logp = ref.gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)
    loss, sums = policy_loss(tr.loss_cfg, logp, batch["advantages"], batch["mask"], total_tokens=total_tokens,
                             rollout_logp=batch.get("rollout_logp"), ref_logp=ref_logp, entropy=entropy)
    loss.backward()
    return loss, sums


def _grads(tr: Trainer) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    tr.optimizer.zero_grad()
    return out


@pytest.fixture(scope="module")
def trainer(checkpoint):
    with Trainer(CFG, checkpoint) as tr:
        with torch.no_grad():  # a reference that differs from the policy: the KL term has gradients
            for p in unwrap(tr.ref_model).parameters():
                p.add_(0.01 * torch.randn_like(p))
        yield tr


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(TL, "default_chunk_rows", lambda vocab_rows: CHUNK)


def test_logprobs_and_entropy_equal_full_logits(trainer, small_chunks):
    items, _ = _items()
    batch = _pack(items, True, trainer.device)
    mask = batch["mask"] > 0
    with torch.no_grad():
        logits = forward_logits(trainer.model, batch["tokens"])[:, :-1].float()
        logp, entropy = masked_token_logprobs(trainer.model, batch["tokens"], batch["mask"])
    full = torch.log_softmax(logits, -1).gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)
    assert int(mask.sum()) > 3 * CHUNK
    torch.testing.assert_close(logp[mask], full[mask], atol=ATOL, rtol=0)
    torch.testing.assert_close(entropy[mask], token_entropy(logits)[mask], atol=ATOL, rtol=0)
    assert not logp[~mask].any() and not entropy[~mask].any()
    samples = [s for s, _ in items]
    for s, ours, row, m in zip(samples, trainer.logprobs(samples), full, range(len(samples))):
        p = len(s.prompt_ids)
        torch.testing.assert_close(torch.tensor(ours), row[p - 1:p - 1 + len(s.response_ids)], atol=ATOL, rtol=0)


def test_loss_metrics_and_gradients_equal_full_logits(trainer, small_chunks):
    items, total = _items()
    trainer.optimizer.zero_grad()
    loss, sums = trainer._micro_batch(items, total)
    ours = _grads(trainer)
    ref_loss, ref_sums = _naive_micro_batch(trainer, items, total)
    theirs = _grads(trainer)
    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=0)
    assert sums["train/kl_loss"] > 0
    assert sums == pytest.approx(ref_sums, abs=ATOL * total)
    assert set(ours) == set(theirs)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=ATOL, rtol=0, msg=name)


class _VocabShapes(TorchDispatchMode):
    """Records the shape of every op output whose last dimension is the vocabulary size."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.shapes = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab:
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def test_no_tensor_holds_more_than_one_chunk_of_logits(tmp_path, small_chunks):
    items, total = _items()
    with Trainer(CFG, _untied_llama(str(tmp_path))) as tr, _VocabShapes(tr.spec.vocab_size) as seen:
        tr._micro_batch(items, total)
    mms = [shape for func, shape in seen.shapes if "mm" in func]
    assert len(mms) >= 2 * (total // CHUNK)  # forward and recomputed output layers, chunk by chunk
    weight_t = (tr.spec.hidden_size, tr.spec.vocab_size)  # the output weight's transposed view
    big = [(func, shape) for func, shape in seen.shapes if shape != weight_t and (len(shape) != 2 or shape[0] > CHUNK)]
    assert not big
