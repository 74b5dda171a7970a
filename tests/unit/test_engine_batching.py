"""The CPU engine's model and continuous batching, without HTTP (miles_core.engines.model/batching).

Pins: log-probs equal a transformers teacher-forced forward pass of the same weights (|diff| <= 1e-4,
float32) for the GPT-2, Llama and Qwen2 layouts, while requests join and leave the batch at every
step; greedy decoding equals transformers' greedy generate; retract (cache dropped and recomputed)
does not change what is generated; an in-place weight swap changes the version of later tokens only;
abort and pause(abort) finish requests with finish_reason abort.
"""

from __future__ import annotations

import pytest
import torch

from miles_core.engines.batching import BatchEngine, Request, SamplingParams
from miles_core.engines.model import CausalLM, ModelLoadError, read_eos_token_ids, read_spec
from miles_core.models.builtin import EOS_ID, materialize_checkpoint

torch.set_num_threads(1)
TOL = 1e-4
MODELS = ["builtin:tiny-gpt", "builtin:tiny-llama", "builtin:tiny-qwen2"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-ckpts")
    return {name: materialize_checkpoint(name, 3, str(root / name.split(":")[1])) for name in MODELS}


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def run_to_completion(engine: BatchEngine, staged: list[list[Request]], before=None) -> dict[str, dict]:
    """Add each stage of requests one step apart; step until all finish. Returns per-rid results."""
    out: dict[str, dict] = {}
    stages = list(staged)
    step = 0
    while stages or engine.num_requests:
        if stages:
            for r in stages.pop(0):
                engine.add(r)
        if before:
            before(step, engine)
        for ev in engine.step():
            d = out.setdefault(ev.rid, {"ids": [], "lps": [], "versions": [], "finish": None})
            if ev.token is not None:
                d["ids"].append(ev.token)
                d["lps"].append(ev.logprob)
                d["versions"].append(ev.version)
            if ev.finish is not None:
                d["finish"] = ev.finish
        step += 1
        assert step < 500
    return out


def mixed_requests(prefix: str, temperature=1.0):
    prompts = [[1, 2, 3, 4, 10], [5, 6, 10], [7, 8, 9, 0, 1, 2, 3, 10], [4, 10], [9, 9, 9, 10]]
    lens = [5, 9, 2, 12, 7]
    return [Request(f"{prefix}{i}", p, SamplingParams(max_new_tokens=n, temperature=temperature, ignore_eos=i % 2 == 0))
            for i, (p, n) in enumerate(zip(prompts, lens))]


@pytest.mark.parametrize("name", MODELS)
def test_logprobs_match_transformers_teacher_forcing(ckpts, name):
    """Engine log-probs of sampled tokens == log_softmax of HF logits on prompt+response (temperature 1),
    with requests staggered so prefill and decode share steps and slots get compacted."""
    engine = BatchEngine(CausalLM.load(ckpts[name]), weight_version=1, seed=7)
    reqs = mixed_requests("r")
    res = run_to_completion(engine, [reqs[:2], [], reqs[2:4], [reqs[4]]])
    model = hf_model(ckpts[name])
    for r in reqs:
        d = res[r.rid]
        assert d["finish"]["type"] in ("stop", "length")
        ids = torch.tensor([r.input_ids + d["ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        n = len(r.input_ids)
        expected = lp[n - 1:-1].gather(1, torch.tensor(d["ids"])[:, None])[:, 0]
        diff = (expected - torch.tensor(d["lps"])).abs().max().item()
        assert diff <= TOL, f"{name} {r.rid}: max |logprob diff| {diff}"


@pytest.mark.parametrize("name", MODELS)
def test_greedy_equals_transformers_generate(ckpts, name):
    """Temperature 0 picks the argmax at every step: same tokens as HF greedy generate."""
    engine = BatchEngine(CausalLM.load(ckpts[name]))
    reqs = [Request(f"g{i}", p, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
            for i, p in enumerate([[1, 2, 3, 4, 10], [3, 10], [8, 1, 7, 10]])]
    res = run_to_completion(engine, [reqs])
    model = hf_model(ckpts[name])
    for r in reqs:
        with torch.no_grad():
            out = model.generate(torch.tensor([r.input_ids]), max_new_tokens=8, do_sample=False,
                                 eos_token_id=None, pad_token_id=12)
        assert res[r.rid]["ids"] == out[0, len(r.input_ids):].tolist()


def test_batch_is_continuous(ckpts):
    """A finished request leaves the running batch at once and a new one joins mid-flight (no waiting
    for the longest sequence)."""
    engine = BatchEngine(CausalLM.load(ckpts["builtin:tiny-gpt"]))
    long = Request("long", [1, 10], SamplingParams(max_new_tokens=20, ignore_eos=True))
    short = Request("short", [2, 10], SamplingParams(max_new_tokens=2, ignore_eos=True))
    engine.add(long)
    engine.add(short)
    engine.step()
    assert [r.rid for r in engine.running] == ["long", "short"]
    events = engine.step()
    assert any(e.rid == "short" and e.finish for e in events)
    assert [r.rid for r in engine.running] == ["long"]
    engine.add(Request("late", [3, 10], SamplingParams(max_new_tokens=3, ignore_eos=True)))
    engine.step()
    assert [r.rid for r in engine.running] == ["long", "late"]


@pytest.mark.parametrize("name", ["builtin:tiny-gpt", "builtin:tiny-llama"])
def test_retract_recomputes_cache_without_changing_output(ckpts, name):
    """pause(retract) drops the cache and re-queues; after resume the re-prefilled requests produce the
    same greedy tokens and log-probs as an uninterrupted run."""
    def reqs():
        return [Request(f"q{i}", p, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))
                for i, p in enumerate([[1, 2, 3, 10], [4, 10], [5, 6, 7, 8, 9, 10]])]

    plain = run_to_completion(BatchEngine(CausalLM.load(ckpts[name])), [reqs()])

    def retract_at_3(step, engine):
        if step == 3:
            assert engine.pause("retract") == []
            assert not engine.running and len(engine.waiting) == 3
            engine.resume()

    again = run_to_completion(BatchEngine(CausalLM.load(ckpts[name])), [reqs()], before=retract_at_3)
    for rid, d in plain.items():
        assert again[rid]["ids"] == d["ids"]
        assert max(abs(a - b) for a, b in zip(again[rid]["lps"], d["lps"])) <= TOL


def test_in_place_weight_swap_versions_later_tokens(ckpts, tmp_path):
    """Paused in place, a weight load keeps the requests; tokens after resume carry the new version."""
    other = materialize_checkpoint("builtin:tiny-gpt", 99, str(tmp_path / "v2"))
    engine = BatchEngine(CausalLM.load(ckpts["builtin:tiny-gpt"]), weight_version=1)

    def swap_at_2(step, eng):
        if step == 2:
            eng.pause("in_place")
            assert eng.step() == []  # paused: nothing runs
            eng.load_weights(CausalLM.load(other), 2)
            eng.resume()

    res = run_to_completion(engine, [[Request("a", [1, 2, 10], SamplingParams(max_new_tokens=6, ignore_eos=True))]],
                            before=swap_at_2)
    assert res["a"]["versions"] == [1, 1, 2, 2, 2, 2]
    assert res["a"]["finish"] == {"type": "length", "length": 6}


def test_abort_and_pause_abort(ckpts):
    """abort(rid) ends one request; pause(abort) ends all (running and waiting) with finish abort."""
    engine = BatchEngine(CausalLM.load(ckpts["builtin:tiny-gpt"]), max_running=2)
    for i in range(4):
        engine.add(Request(f"x{i}", [1, 10], SamplingParams(max_new_tokens=20, ignore_eos=True)))
    engine.step()
    ev = engine.abort("x0")
    assert [(e.rid, e.finish["type"]) for e in ev] == [("x0", "abort")]
    assert engine.abort("nope") == []
    ev = engine.pause("abort")
    assert sorted(e.rid for e in ev) == ["x1", "x2", "x3"] and all(e.finish["type"] == "abort" for e in ev)
    assert engine.num_requests == 0 and not engine.running and not engine.waiting


def test_stop_tokens_eos_and_position_limit(ckpts):
    """stop_token_ids and EOS end with type stop + matched; the model's position limit ends with length."""
    engine = BatchEngine(CausalLM.load(ckpts["builtin:tiny-gpt"]))
    res = run_to_completion(engine, [[
        Request("stop", [1, 10], SamplingParams(max_new_tokens=25, top_k=1, stop_token_ids=tuple(range(13)))),
        Request("limit", [1] * 28 + [10], SamplingParams(max_new_tokens=100, ignore_eos=True)),
    ]])
    assert res["stop"]["finish"]["type"] == "stop" and len(res["stop"]["ids"]) == 1
    assert res["stop"]["finish"]["matched"] == res["stop"]["ids"][0]
    assert res["limit"]["finish"] == {"type": "length", "length": 3}  # 32 positions - 29 prompt tokens
    assert EOS_ID in read_eos_token_ids(ckpts["builtin:tiny-gpt"])


def test_top_k_1_and_tiny_top_p_are_greedy(ckpts):
    """top_k=1 and top_p close to 0 leave only the argmax token."""
    engine = BatchEngine(CausalLM.load(ckpts["builtin:tiny-llama"]), seed=3)
    mk = lambda rid, **kw: Request(rid, [1, 2, 10], SamplingParams(max_new_tokens=6, ignore_eos=True, **kw))
    res = run_to_completion(engine, [[mk("g", temperature=0.0), mk("k", top_k=1, temperature=2.0),
                                      mk("p", top_p=1e-6, temperature=1.5)]])
    assert res["g"]["ids"] == res["k"]["ids"] == res["p"]["ids"]


def test_bad_requests_are_refused(ckpts):
    engine = BatchEngine(CausalLM.load(ckpts["builtin:tiny-gpt"]))
    with pytest.raises(ValueError, match="out of range"):
        engine.add(Request("a", [99], SamplingParams()))
    with pytest.raises(ValueError, match="positions"):
        engine.add(Request("b", [1] * 40, SamplingParams()))
    with pytest.raises(ValueError, match="unsupported keys"):
        SamplingParams.from_json({"max_new_tokens": 3, "bogus": 1})
    ev = engine.add(Request("z", [1], SamplingParams(max_new_tokens=0)))
    assert ev[0].finish == {"type": "length", "length": 0}


def test_unsupported_checkpoint_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ModelLoadError, match="model_type='bert'"):
        CausalLM.load(str(tmp_path))
