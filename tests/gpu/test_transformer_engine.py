"""Transformer Engine's layer spec on a GPU where the `transformer_engine` package is installed
(skipped where it is not: the device machine's image and the project's GPU image do not ship it).

Pins: --transformer-impl transformer_engine builds TE's fused layers; the HF checkpoint loads into
them under the local spec's names and exports back unchanged; their log-probs match the local
spec's on the same weights (bf16: within 2e-2); a packed token-budget row (THD, cu_seqlens) gives
the padded rows' log-probs.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from miles_core.config.sections import TrainSection
from miles_core.models.builtin import materialize_checkpoint
from tests.unit.test_train import make_groups

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def te_present():
    if not torch.cuda.is_available():
        pytest.fail("the gpu suite needs CUDA (run it with tests/gpu/check.sh on a GPU machine)")
    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("transformer_engine is not installed on this GPU machine")


def test_te_layers_load_export_and_match_the_local_spec(tmp_path):
    from miles_core.train.trainer import Trainer

    hf_dir = materialize_checkpoint("builtin:tiny-llama", 1, str(tmp_path / "llama"))
    samples = [s for g in make_groups(4, seed=3) for s in g.samples]
    out = {}
    for impl in ("local", "transformer_engine"):
        cfg = dataclasses.replace(TrainSection(), transformer_impl=impl)
        with Trainer(cfg, hf_dir) as tr:
            assert tr.model.module.miles_transformer_impl == impl
            out[impl] = {"logprobs": tr.logprobs(samples), "hf": tr.hf_state_dict(torch.float32)}
    for a, b in zip(out["local"]["logprobs"], out["transformer_engine"]["logprobs"]):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=2e-2)
    assert set(out["local"]["hf"]) == set(out["transformer_engine"]["hf"])
    for k, v in out["local"]["hf"].items():
        assert torch.equal(out["transformer_engine"]["hf"][k], v), k


def test_te_packed_row_matches_padded_rows(tmp_path):
    from miles_core.train.megatron_model import masked_token_logprobs
    from miles_core.train.packing import pack_rows
    from miles_core.train.trainer import Trainer

    hf_dir = materialize_checkpoint("builtin:tiny-llama", 1, str(tmp_path / "llama"))
    samples = [s for g in make_groups(2, seed=5) for s in g.samples][:4]
    cfg = dataclasses.replace(TrainSection(), transformer_impl="transformer_engine")
    with Trainer(cfg, hf_dir) as tr, torch.no_grad():
        padded = tr.logprobs(samples)
        tokens = [torch.tensor(list(s.prompt_ids) + list(s.response_ids)) for s in samples]
        masks = [{"mask": torch.tensor([0.0] * (len(s.prompt_ids) - 1) + [1.0] * len(s.response_ids))}
                 for s in samples]
        row = pack_rows(tokens, masks, tr.device)
        logp, _ = masked_token_logprobs(tr.model, row["tokens"], row["mask"], position_ids=row["position_ids"],
                                        attention_mask=row["attention_mask"])
    got = logp[row["mask"] > 0].tolist()
    want = [x for lp in padded for x in lp]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=2e-2)
