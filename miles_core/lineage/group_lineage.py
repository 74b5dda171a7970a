"""`miles lineage RUN_URI GROUP_ID [--json]`: where one prompt group came from and where it went.

    trace = group_lineage("file:///x/.miles/runs/default", "e0-p17-a0")   # LineageError if unknown
    print(render_lineage(trace))

From the run root alone: who generated it (a producer job and its host, or the run's own rollout:
miles_core.lineage.producers), the group's object and prompt (decoded with the run's tokenizer), each
sample's status, reward, response and the weight versions of its tokens; the step whose
consumption manifest lists it (trained, or rejected at get). For a trained group: the first
complete checkpoint and the first snapshot that include that step, and the eval results around it
(the last evaluated step before it and the first at or after it, per dataset). A snapshot counts
when it is complete now or its record remains after it was retired (an eval result or eval request
that names it): `snapshot_retired` says which. A rejected group was never trained: no checkpoint,
snapshot or eval includes it.
"""

from __future__ import annotations

import difflib
import json
from collections import Counter

from miles_core.buffer.manifests import ConsumptionRecord
from miles_core.buffer.objects import consumed_key, rows_to_group
from miles_core.eval.results import all_results, requests
from miles_core.eval.snapshots import SnapshotLayout
from miles_core.lineage.producers import TRAINER, producer_of
from miles_core.lineage.recorded import LineageError, RecordedRun
from miles_core.rollout.assembly import tokenizer_decode


def group_lineage(run_uri: str, group_id: str) -> dict:
    run = RecordedRun.open(run_uri)
    found, ids = _find_group(run, group_id)
    record = run.consumption()
    fate = _fate(record, group_id, found[0] if found else None)
    if found is None and fate is None:
        raise LineageError(_unknown(run, group_id, ids) + _unreadable_hint(run, record))
    trained = fate["step"] if fate is not None and fate["outcome"] == "consumed" else None
    return {"run_uri": run.uri, "group_id": group_id, "generated_by": producer_of(run.store, group_id),
            **(_describe(run, *found) if found else {"object": None, "note": _deleted_note(run)}),
            "fate": fate, **_what_includes(run, trained)}


def _what_includes(run: RecordedRun, step: int | None) -> dict:
    """The first checkpoint and snapshot that include trained step `step` and the evals around it;
    none of them when `step` is None (the group was never trained)."""
    if step is None:
        return {"checkpoint": None, "snapshot": None, "snapshot_retired": None, "eval": {}}
    results = all_results(run.store)
    snapshots = recorded_snapshots(run, results)
    snapshot = _first_at_or_after(sorted(snapshots), step)
    return {"checkpoint": _first_at_or_after(run.complete_steps(), step), "snapshot": snapshot,
            "snapshot_retired": None if snapshot is None else not snapshots[snapshot],
            "eval": _eval_neighbourhood(results, step)}


def recorded_snapshots(run: RecordedRun, results: list) -> dict[int, bool]:
    """step -> whether its snapshot is complete now, for every snapshot the run made: the complete
    ones, and retired ones whose eval result or eval request still names them."""
    present = SnapshotLayout.from_config(run.cfg, run.uri).complete_steps()
    named = [r.step for r in results if r.snapshot_uri] + [s for s, req in requests(run.store).items()
                                                            if req.get("snapshot_uri")]
    return {**{s: False for s in named}, **{s: True for s in present}}


def _find_group(run: RecordedRun, group_id: str):
    """((object key, its Group), None) when found, else (None, every committed group id)."""
    ids: list[str] = []
    for key, _, stored in run.read_objects(run.group_keys()):
        for sg in stored:
            if sg.group_id == group_id:
                return (key, sg), ids
            ids.append(sg.group_id)
    return None, ids


def _fate(record: ConsumptionRecord, group_id: str, key: str | None) -> dict | None:
    """{"step", "outcome": consumed | rejected} from the first manifest that lists the group; outcome
    "consumed_or_rejected" at the step of a manifest rebuilt from the compaction record that lists it; when
    none does but a manifest that does not parse may have, outcome "unknown" with those steps."""
    for step, manifest in record.manifests.items():
        for outcome in ("consumed", "rejected"):
            if group_id in manifest.get(outcome, ()):
                return {"step": step, "outcome": outcome}
    if group_id in record.rebuilt:  # its manifest was rebuilt from the compaction record (`miles doctor --repair`)
        return {"step": record.rebuilt[group_id], "outcome": "consumed_or_rejected"}
    covered = record.covered(group_id, key)
    steps = record.unreadable_covered() if covered else record.unreadable_after() if key else []
    if not steps:
        return None
    return {"step": None, "outcome": "unknown", "unreadable_steps": steps, "consumed_or_rejected": covered}


def _unreadable_hint(run: RecordedRun, record: ConsumptionRecord) -> str:
    if not record.unreadable:
        return ""
    keys = ", ".join(run.store.uri(consumed_key(s)) for s in record.unreadable)
    return f" Consumption manifests that do not parse (the group may be named there): {keys}."


def _describe(run: RecordedRun, key: str, stored) -> dict:
    decode = tokenizer_decode(run.cfg)
    group = rows_to_group(stored.rows)
    first = group.samples[0]
    return {"object": run.store.uri(key), "prompt_index": group.prompt_index,
            "prompt": decode(first.prompt_ids), "prompt_tokens": len(first.prompt_ids), "label": first.label,
            "samples": [{"sample_index": s.sample_index, "status": str(getattr(s.status, "value", s.status)),
                         "reward": s.reward, "response": decode(s.response_ids), "response_tokens": len(s.response_ids),
                         "versions": dict(sorted(Counter(s.token_versions).items())),
                         **_episode(decode, s)} for s in group.samples]}


def _episode(decode, sample) -> dict:
    """A multi-turn sample's turns (the response cut where its loss mask changes: the model's tokens and
    the environment's, a tool's answers among them) and its tool counts when its metadata has them;
    nothing for a single-turn sample."""
    out: dict = {}
    try:
        tool = json.loads(sample.metadata or "{}").get("tool")
    except (ValueError, AttributeError):
        tool = None
    if isinstance(tool, dict):
        out["tool"] = tool
    mask = list(sample.loss_mask)
    if 0 in mask[:len(sample.response_ids)]:
        turns, start = [], 0
        for i in range(1, len(mask) + 1):
            if i == len(mask) or mask[i] != mask[start]:
                turns.append({"by": "model" if mask[start] else "environment",
                              "text": decode(sample.response_ids[start:i])})
                start = i
        out["turns"] = turns
    return out


def _deleted_note(run: RecordedRun) -> str:
    why = " (--buffer-delete-consumed-objects)" if run.cfg.buffer.buffer_delete_consumed_objects else ""
    return f"its object is gone: deleted after consumption{why}; only its manifest entry remains"


def _first_at_or_after(steps: list[int], step: int | None) -> int | None:
    return None if step is None else next((s for s in steps if s >= step), None)


def _eval_neighbourhood(results: list, step: int) -> dict[str, dict]:
    """dataset -> {"before": row or None, "after": row or None} around `step`."""
    out: dict[str, dict] = {}
    for result in results:
        row = {"step": result.step, "mean_reward": result.to_row().get("mean_reward")}
        near = out.setdefault(result.dataset, {"before": None, "after": None})
        if result.step < step:
            near["before"] = row
        elif near["after"] is None:
            near["after"] = row
    return out


def _unknown(run: RecordedRun, group_id: str, ids: list[str]) -> str:
    close = difflib.get_close_matches(group_id, ids, n=3)
    hint = f"; close: {', '.join(close)}" if close else ""
    return (f"no group {group_id!r} in {run.uri}: not in any of its {len(ids)} committed groups nor in any "
            f"consumption manifest{hint}. Group ids look like e{{epoch}}-p{{position}}-a{{attempt}}[-{{producer}}] "
            "(`miles buffer inspect RUN_URI --ids` lists them).")


# ----------------------------------------------------------------------------- text


def render_lineage(t: dict) -> str:
    lines = [f"group        {t['group_id']} in {t['run_uri']}", _generated_line(t["generated_by"])]
    if t["object"] is None:
        lines.append(f"object       {t['note']}")
    else:
        lines += [f"object       {t['object']}", f"prompt       #{t['prompt_index']} ({t['prompt_tokens']} tokens): "
                  f"{t['prompt']!r}", f"label        {t['label']!r}"]
        for s in t["samples"]:
            tool = s.get("tool")
            tools = (f", tool calls {tool.get('calls', 0)} (errors {tool.get('errors', 0)}, timeouts "
                     f"{tool.get('timeouts', 0)})") if tool else ""
            if "turns" not in s:
                lines.append(f"  sample {s['sample_index']}: {s['status']}, reward {_num(s['reward'])}, "
                             f"{s['response_tokens']} tokens {s['response']!r}, versions {_versions(s['versions'])}{tools}")
                continue
            lines.append(f"  sample {s['sample_index']}: {s['status']}, reward {_num(s['reward'])}, {s['response_tokens']} "
                         f"tokens in {len(s['turns'])} turns, versions {_versions(s['versions'])}{tools}")
            lines += [f"    {turn['by']:<12} {turn['text']!r}" for turn in s["turns"]]
    lines.append(_fate_line(t["fate"]))
    if t["fate"] is not None and t["fate"]["outcome"] in ("unknown", "consumed_or_rejected"):
        return "\n".join(lines)
    if t["fate"] is not None and t["fate"]["outcome"] == "rejected":
        lines.append("             never trained: no checkpoint, snapshot or eval includes it (with "
                     "--async-unused-samples-handler retry its prompt went back to the data source)")
        return "\n".join(lines)
    retired = "; retired since, its eval results remain" if t.get("snapshot_retired") else ""
    lines += [f"checkpoint   {_or_none(t['checkpoint'], 'step {} (the first that includes it)')}",
              f"snapshot     {_or_none(t['snapshot'], 'step {} (the first that includes it' + retired + ')')}"]
    lines += [f"eval {name:<8}before: {_eval_row(n['before'])}; after: {_eval_row(n['after'])}"
              for name, n in sorted(t["eval"].items())]
    return "\n".join(lines)


def _generated_line(by: dict) -> str:
    if by["producer_id"] == TRAINER:
        return "generated    by the run's own rollout"
    return f"generated    by producer job {by['producer_id']} (host {by['host'] or 'unknown: no heartbeat record'})"


def _versions(counts: dict) -> str:
    return ", ".join(f"v{v} x{n}" for v, n in counts.items()) or "none (no response tokens)"


def _fate_line(fate: dict | None) -> str:
    if fate is None:
        return "consumed     not yet (still in the buffer, or in flight)"
    if fate["outcome"] == "unknown":
        steps = ", ".join(map(str, fate["unreadable_steps"]))
        if fate["consumed_or_rejected"]:
            return (f"consumed     or rejected (the compaction record says so), at a step whose consumption manifest "
                    f"does not parse: {steps}")
        return (f"consumed     unknown: no readable manifest names it, and the manifests of steps {steps} do not "
                "parse (it may have been trained there, or still be in the buffer)")
    if fate["outcome"] == "consumed_or_rejected":
        return (f"consumed     or rejected at step {fate['step']} (its consumption manifest was rebuilt from the "
                "compaction record, which does not say which)")
    if fate["outcome"] == "rejected":
        return f"rejected     at step {fate['step']}: too stale (--max-weight-staleness) when the trainer took it"
    return f"consumed     trained at step {fate['step']}"


def _eval_row(row: dict | None) -> str:
    if row is None:
        return "none"
    return f"step {row['step']} mean reward {_num(row['mean_reward'])}"


def _num(value: float | None) -> str:
    return "none" if value is None else f"{value:.3f}"


def _or_none(value, fmt: str) -> str:
    return "none yet" if value is None else fmt.format(value)
