"""What a run that allows rollout producer jobs must be (miles_core.config.rules `_producer_rules`):
each refusal names its flags and says "not supported" or what to do."""

from __future__ import annotations

import pytest

from miles_core.config import ConfigError, parse_flags


@pytest.mark.parametrize("flags, said", [
    (["--no-fully-async", "--one-step-off"], "--allow-rollout-producers with the one-step-off driver is not supported"),
    (["--custom-async-data-buffer-path", "x:Y"], "--custom-async-data-buffer-path is not supported"),
    (["--rollout-num-engines", "0", "--async-unused-samples-handler", "retry"], "with --rollout-num-engines 0 is not"),
    (["--buffer-delete-consumed-objects"], "--buffer-delete-consumed-objects is not supported"),
    (["--prompt-claim-block-size", "0"], "--prompt-claim-block-size=0 must be >= 1"),
    (["--producer-poll-seconds", "0"], "--producer-poll-seconds=0.0 must be > 0"),
])
def test_producer_settings_that_cannot_work_are_refused_by_name(flags, said):
    with pytest.raises(ConfigError) as e:
        parse_flags(["--preset", "tiny-reverse4", "--allow-rollout-producers", *flags])
    assert said in str(e.value)


def test_producers_with_no_engine_of_its_own_is_a_valid_run():
    cfg = parse_flags(["--preset", "tiny-reverse4", "--allow-rollout-producers", "--rollout-num-engines", "0"])
    assert cfg.engine.rollout_num_engines == 0 and cfg.buffer.prompt_claim_block_size is None
