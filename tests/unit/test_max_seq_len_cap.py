"""--max-seq-len caps each response at max_seq_len - len(prompt) new tokens (and at
--rollout-max-response-len): the producer's per-sample sampling params, and the range check."""

from __future__ import annotations

import asyncio

import pytest

from miles_core.config import ConfigError, embedded_default, replace_fields
from miles_core.prepare.checks import validate
from miles_core.rollout.admission import StalenessAdmission, SubmissionBudget
from miles_core.rollout.data_source import DataSource
from miles_core.rollout.producer import Producer, sample_params
from miles_core.rollout.rewards import Rewarder
from tests.unit.test_producer import MemoryBuffer, Result, run


class RecordingEngine:
    """Answers at once, recording each request's prompt and sampling params."""

    def __init__(self):
        self.requests: list[tuple[list[int], dict]] = []

    async def generate(self, input_ids, sampling_params=None):
        self.requests.append((list(input_ids), dict(sampling_params)))
        await asyncio.sleep(0)
        return Result([1], [-0.5], [1], "stop", 1)


@pytest.mark.parametrize("max_seq_len,prompt_len,want", [
    (None, 5, 8),   # no cap: --rollout-max-response-len
    (100, 5, 8),    # room for more than the response length
    (10, 5, 5),     # the cap binds
    (6, 5, 1),      # exactly one token of room
])
def test_sample_params_caps_max_new_tokens(max_seq_len, prompt_len, want):
    params = {"max_new_tokens": 8, "temperature": 1.0}
    got = sample_params(params, prompt_len, max_seq_len)
    assert got == {"max_new_tokens": want, "temperature": 1.0}
    assert params == {"max_new_tokens": 8, "temperature": 1.0}  # the shared dict is not changed


def test_sample_params_without_a_response_len_uses_the_room():
    assert sample_params({"temperature": 1.0}, 4, 10)["max_new_tokens"] == 6


@pytest.mark.parametrize("prompt_len", [10, 11])
def test_a_prompt_leaving_no_room_is_a_clear_error(prompt_len):
    with pytest.raises(ValueError, match="--max-seq-len=10"):
        sample_params({"max_new_tokens": 8}, prompt_len, 10)


def test_the_producer_caps_each_sample_by_its_prompt_length():
    rows = [{"prompt": [i] + [10] * i, "label": "", "task": "t", "metadata": "{}"} for i in range(4)]

    async def main():
        eng = RecordingEngine()
        producer = Producer(source=DataSource(rows, 2, seed=1, shuffle=False), engine=eng, sink=MemoryBuffer(),
                            rewarder=Rewarder(lambda s: 1.0), budget=SubmissionBudget(2, 2, "sample"),
                            admission=StalenessAdmission(None, 2), sampling_params={"max_new_tokens": 2},
                            batch_mode=True, max_seq_len=4)
        producer.allow(3)  # prompt lengths 1, 2, 3: room 3, 2, 1
        producer.start()
        while producer.admission.started_groups < 3 or producer.in_flight_groups:
            await asyncio.sleep(0.005)
        await producer.stop(grace_seconds=1)
        assert producer.error is None
        got = sorted((len(p), params["max_new_tokens"]) for p, params in eng.requests)
        assert got == [(1, 2), (1, 2), (2, 2), (2, 2), (3, 1), (3, 1)]

    run(main())


def test_max_seq_len_range_check():
    cfg = replace_fields(embedded_default(), max_seq_len=1)
    with pytest.raises(ConfigError, match="--max-seq-len=1 must be >= 2"):
        validate(cfg)
    validate(replace_fields(embedded_default(), max_seq_len=2))
    validate(replace_fields(embedded_default(), max_seq_len=None))
