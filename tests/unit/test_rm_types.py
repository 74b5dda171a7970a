"""miles' reward types (`--rm-type`, miles_core.rollout.rm_types) on tables of known answers: right,
wrong, equivalent forms, malformed output; the boxed_ prefix; the choice of reward (--custom-rm-path wins,
as in miles); one that hangs fails its sample under --reward-timeout-seconds and is counted; an
unknown type is refused by name. math-verify runs on the Rewarder's threads (its signal-based timeout
would refuse to), so the tables are scored through a Rewarder too.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from miles_core.config import ConfigError, parse_flags
from miles_core.rollout import rm_types
from miles_core.rollout.rewards import Rewarder, load_reward, task_reward
from miles_core.samples import Group, Sample, SampleStatus

HANG_CUT_SECONDS = 0.3  # the rewarder's bound on a reward that hangs: the sample fails, counted

MATH = [  # (response, label, reward)
    ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),           # a fraction against a decimal
    ("so x = \\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("\\boxed{10\\%}", "0.1", 1.0),                                  # a percentage
    ("The length is \\boxed{5\\text{ cm}}", "5", 1.0),               # units in \text{} dropped
    ("We get $x = 3$.", "3", 1.0),
    ("\\boxed{2}", "3", 0.0),                                        # wrong
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("I cannot solve this.", "7", 0.0),                              # no math at all
    ("\\boxed{", "1", 0.0),                                          # malformed
    ("", "1", 0.0),
]
DEEPSCALER = [
    ("<think>maybe 4</think> so \\boxed{\\frac{6}{4}}", "1.5", 1.0),  # graded after </think>
    ("<think>\\boxed{1.5}</think> the answer is 2", "1.5", 0.0),        # a box only inside the thinking
    ("###Response the result is \\boxed{3}", "\\boxed{3}", 1.0),
    ("\\boxed{1.5}", "1.5", 0.0),                                       # neither </think> nor ###Response
    ("<think></think>\\boxed{7}", "", 0.0),
]
DAPO = [
    ("Work... Answer: 42", "42", 1.0),
    ("Answer: 1,234 dollars", "1234", 1.0),                          # commas and units normalized
    ("Answer: $\\boxed{17}$", "17", 1.0),
    ("Answer: 41", "42", -1.0),
    ("the answer is 42", "42", -1.0),                                # no "Answer:" line
    ("x" * 400 + "\nAnswer: 42", "42", 1.0),                         # within the last 300 characters
    ("Answer: 42\n" + "x" * 400, "42", -1.0),                        # cut off before them
]
F1 = [
    ("The Eiffel Tower", "eiffel tower", 1.0),
    ("Paris France", "Paris", 2 * 0.5 * 1.0 / 1.5),                  # precision 1/2, recall 1
    ("yes", "no", 0.0),
    ("no", "no", 1.0),
    ("London", "Paris", 0.0),
]


def _sample(label: str) -> Sample:
    return Sample("g", 0, 0, [1], [2], label=label, status=SampleStatus.COMPLETED)


def _score_through_a_rewarder(name: str, table, timeout: float | None = None) -> list:
    texts = {i: row[0] for i, row in enumerate(table)}
    samples = [Sample("g", 0, i, [1], [i], label=row[1], status=SampleStatus.COMPLETED) for i, row in enumerate(table)]
    rewarder = Rewarder(load_reward("", name), decode=lambda ids: texts[ids[0]], timeout_seconds=timeout)
    try:
        asyncio.run(rewarder.score_group(Group("g", 0, samples)))
    finally:
        rewarder.close()
    return samples


@pytest.mark.parametrize("name, table", [("math", MATH), ("deepscaler", DEEPSCALER), ("dapo", DAPO), ("f1", F1)])
def test_reward_types_on_known_answers(name, table):
    got = [s.reward for s in _score_through_a_rewarder(name, table)]
    assert got == pytest.approx([row[2] for row in table]), list(zip([r[0] for r in table], got))
    assert threading.current_thread() is threading.main_thread()  # scored on the Rewarder's threads, not here


def test_boxed_prefix_scores_the_last_box_only():
    f1 = rm_types.rm_type_reward("boxed_f1")
    assert f1(_sample("Paris"), "I think London, so \\boxed{Paris}") == 1.0
    assert f1(_sample("Paris"), "Paris, no box") == 0.0
    assert rm_types.rm_type_reward("boxed_math")(_sample("0.5"), "\\boxed{1/2} and 7") == 1.0


def test_custom_rm_path_wins_and_no_setting_is_the_task_reward():
    assert load_reward("", "") is task_reward
    assert load_reward("miles_core.rollout.rewards:exact_match", "math").__name__ == "exact_match"
    assert load_reward("", "dapo").__name__ == "rm_type_dapo"


def test_a_reward_that_hangs_fails_its_sample_and_is_counted(monkeypatch):
    release = threading.Event()

    def hang(answer, label):
        release.wait(30)
        return True

    monkeypatch.setattr(rm_types, "math_equal", hang)
    try:
        samples = _score_through_a_rewarder("math", [("\\boxed{1}", "1", None)], timeout=HANG_CUT_SECONDS)
    finally:
        release.set()
    (s,) = samples
    assert s.status == SampleStatus.FAILED and s.reward is None
    assert "timed out" in json.loads(s.metadata)["reward_error"] or "0.3" in json.loads(s.metadata)["reward_error"]


def test_rm_type_flag_is_validated_by_name():
    assert parse_flags(["--preset", "tiny-reverse4", "--rm-type", "boxed_math"]).rollout.rm_type == "boxed_math"
    with pytest.raises(ConfigError, match=r"--rm-type=gpqa is not supported: supported are math, deepscaler, dapo, f1"):
        parse_flags(["--preset", "tiny-reverse4", "--rm-type", "gpqa"])
    with pytest.raises(ValueError, match="not supported"):
        rm_types.rm_type_reward("remote_rm")
