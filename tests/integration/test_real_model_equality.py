"""A real model (SmolLM2-135M-Instruct, imported from its GGUF) through the trainer and the CPU engine.

Why: the tiny builtin models cannot show that the trainer's Megatron model and the CPU engine
compute what transformers computes for a real checkpoint (30 layers, GQA 9/3 heads, head_dim 64,
RoPE theta 1e5, tied embeddings, a 49k vocabulary, a chat template).

Pins, on chat-templated prompts: (a) the trainer's HF export loads in `transformers` with the
source weights bit for bit, and its fp32 logits match the trainer's own (full logits within 2e-4,
measured 6.4e-5; response-token log-probs from `Trainer.logprobs` within 1e-4, measured 8.8e-6);
(b) greedy text from the CPU engine server (16 new tokens) equals transformers' greedy `generate`,
token for token, and the engine's log-probs of those tokens match transformers' within 1e-4
(measured 1.2e-5). The measured differences are printed (run with -s).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

REAL_ENGINE_START_SECONDS = 300  # an engine start on a real model: its checkpoint loads slower than a tiny one

pytestmark = pytest.mark.slow
torch.set_num_threads(2)

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 7?",
             "Name three primary colors.", "Explain gravity in one sentence."]
NEW_TOKENS = 16
LOGIT_TOL = 2e-4  # fp32 over 30 layers and a 49k vocabulary; measured 6.4e-5
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(smollm2_hf):
    return smollm2_hf[1]


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_greedy(model_dir, prompts) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (its new tokens, EOS included when reached)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
            out.append(gen[0, len(ids):].tolist())
    return out


def hf_logits(model_dir: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0] for s in sequences]


def test_trainer_export_matches_transformers(model_dir, prompts, hf_greedy, tmp_path):
    from miles_core.config.sections import TrainSection
    from miles_core.samples import Sample, SampleStatus
    from miles_core.train.megatron_model import forward_logits
    from miles_core.train.trainer import Trainer

    samples = [Sample(f"g{i}", i, 0, p, r, [], [], [1] * len(r), status=SampleStatus.COMPLETED)
               for i, (p, r) in enumerate(zip(prompts, hf_greedy))]
    with Trainer(TrainSection(), model_dir) as tr:
        out = tr.export_hf(str(tmp_path / "export"))
        trainer_lp = tr.logprobs(samples)
        with torch.no_grad():
            trainer_logits = [forward_logits(tr.model, torch.tensor([p + r]))[0].float() for p, r in
                              zip(prompts, hf_greedy)]
    exported = load_file(os.path.join(out, "model.safetensors"))
    source = load_file(os.path.join(model_dir, "model.safetensors"))
    assert set(exported) == set(source) and all(torch.equal(exported[k], source[k]) for k in source)
    ref = hf_logits(out, [p + r for p, r in zip(prompts, hf_greedy)])
    logit_diff = max((a - b).abs().max().item() for a, b in zip(trainer_logits, ref))
    lp_diff = 0.0
    for (p, r), lp, logits in zip(zip(prompts, hf_greedy), trainer_lp, ref):
        want = F.log_softmax(logits[len(p) - 1:len(p) + len(r) - 1], -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
        lp_diff = max(lp_diff, (torch.tensor(lp) - want).abs().max().item())
    print(f"\ntrainer vs transformers (SmolLM2, fp32, {len(prompts)} prompts): max |logit diff| = {logit_diff:.3g}, "
          f"max |response log-prob diff| = {lp_diff:.3g}")
    assert logit_diff <= LOGIT_TOL and lp_diff <= LOGPROB_TOL


def test_cpu_engine_greedy_equals_transformers(model_dir, prompts, hf_greedy):
    from transformers import AutoTokenizer

    from miles_core.engines.client import EngineClient
    from miles_core.engines.launcher import EngineLaunchSpec, EngineServer

    server = EngineServer(EngineLaunchSpec("cpu", model_path=model_dir, weight_version=1,
                                           startup_timeout_seconds=REAL_ENGINE_START_SECONDS))
    server.start()
    try:
        async def go():
            async with EngineClient([server.url]) as c:
                return [await c.generate(p, {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}) for p in prompts]

        results = asyncio.run(go())
    finally:
        server.stop()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = hf_logits(model_dir, [p + r.output_ids for p, r in zip(prompts, results)])
    lp_diff, same = 0.0, []
    for p, want, res, logits in zip(prompts, hf_greedy, results, ref):
        got = res.output_ids
        same.append(tok.decode(got) == tok.decode(want))
        print(f"\n  engine: {tok.decode(got, skip_special_tokens=True)!r}"
              f"\n  hf:     {tok.decode(want, skip_special_tokens=True)!r}")
        lp = F.log_softmax(logits[len(p) - 1:len(p) + len(got) - 1], -1).gather(-1, torch.tensor(got)[:, None])[:, 0]
        lp_diff = max(lp_diff, (torch.tensor(res.output_logprobs) - lp).abs().max().item())
    print(f"CPU engine vs transformers greedy (SmolLM2, {NEW_TOKENS} new tokens): texts equal {sum(same)}/{len(same)}, "
          f"max |engine log-prob diff| = {lp_diff:.3g}")
    assert [r.output_ids for r in results] == hf_greedy
    assert all(same) and lp_diff <= LOGPROB_TOL
