"""`miles lineage` on agentic episodes: a multi-turn sample is shown turn by turn (the model's tokens and
the environment's, the tool's answers among them) with its tool calls, errors and timeouts; a
single-turn sample keeps its one line."""

from __future__ import annotations

import json

from miles_core.lineage.group_lineage import _episode, group_lineage, render_lineage
from miles_core.samples import Sample
from tests.support.small_run import small_run


def decode(ids):
    return "".join(chr(i) for i in ids)


def test_an_episode_is_cut_into_turns_where_its_loss_mask_changes():
    call, env, answer = '<tool_call>{"expression": "1 + 2"}', '\ntool\n{"result": 3}\n', "3"
    s = Sample("g", 0, 0, [1], [ord(c) for c in call + env + answer],
               loss_mask=[1] * len(call) + [0] * len(env) + [1] * len(answer),
               metadata=json.dumps({"task": "arith", "tool": {"calls": 1, "errors": 0, "timeouts": 0}}))
    got = _episode(decode, s)
    assert got["turns"] == [{"by": "model", "text": call}, {"by": "environment", "text": env},
                            {"by": "model", "text": answer}]
    assert got["tool"] == {"calls": 1, "errors": 0, "timeouts": 0}
    plain = Sample("g", 0, 1, [1], [65, 66], loss_mask=[1, 1])
    assert _episode(decode, plain) == {}


def test_lineage_prints_the_turns_and_tool_counts_of_an_episode(tmp_path):
    run = small_run(tmp_path)
    t = group_lineage(run.uri, run.trained[1])
    t["samples"][0].update(turns=[{"by": "model", "text": "<tool_call>"}, {"by": "environment", "text": '{"result": 3}'},
                                  {"by": "model", "text": "3"}], tool={"calls": 1, "errors": 1, "timeouts": 0})
    text = render_lineage(t)
    assert "in 3 turns" in text and "tool calls 1 (errors 1, timeouts 0)" in text
    assert "    environment  '{\"result\": 3}'" in text
    assert f"  sample {t['samples'][1]['sample_index']}: " in text and "turns" not in text.split("sample 1:")[1].split("\n")[0]
