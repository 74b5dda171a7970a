"""Damaged run roots, continued with the real `pyflyte run`: each resumes correctly or is refused by name.

A template run root is made once per backend by a real `pyflyte run` of the embedded default, small (a first
segment of 4 steps of a 6-step run, 8 groups a step, checkpoints and evals every 2 steps, its producer's lead
left in the buffer): one on file://, one on S3 (SeaweedFS). Each case copies
its backend's template to a run id of its own, damages one file of the layout (truncated, empty, garbage,
missing, extra, duplicated, or in an older version's format), then:
- `miles doctor --json` names the damaged key with the finding kind and severity the case expects, and
  exits 1 exactly when it reports an error;
- `miles runs show`, `miles buffer inspect` and `miles lineage` (a group step 2 trained) exit 0 with the
  template's counts less what the damage destroyed, or name what they cannot count; none prints a traceback;
- `pyflyte run` continues it to 6 steps: it finishes, and the independent reader (tests/chaos/checker.py)
  finds every step's manifest once, no group or prompt consumed twice and no group committed before the
  damage lost (but those the damage destroyed); or it is refused with a message naming the damaged file
  and the fix, and, where `miles doctor --repair` has a repair, the repaired run root continues so.

The continuations run WORKERS at a time (a continuation mostly waits on its processes): the module fixture
damages and checks every selected case, hands its continuation to a pool and each test waits for its own.
Cases that resume share a continuation (BUNDLES): each is damaged and checked by doctor and the readers on a
copy of its own, and the bundle's continuation runs one more copy holding every damage of the bundle at once,
which must finish with the checker's findings clean less what all of them destroyed. A continuation is a whole
`pyflyte run` (about 35 CPU-seconds): 13 resuming cases in 4 continuations instead of 13.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from miles_core.buffer.inspect import inspect_buffer
from miles_core.cli import main
from miles_core.storage import Store
from tests.chaos import checker
from tests.support.processes import kill_everything_under
from tests.support.timeouts import LONG_RUN_SECONDS, SLOW_COMMAND_SECONDS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PYFLYTE = str(Path(sys.executable).with_name("pyflyte"))
MILES = str(Path(sys.executable).with_name("miles"))
STEPS, MORE, BATCH = 4, 6, 8  # the template trains STEPS steps of BATCH groups; each case continues to MORE
FLAGS = (f"--preset tiny-reverse4 --save-interval 2 --eval-interval 2 --rollout-batch-size {BATCH} --n-samples-per-prompt 4 --eval-max-prompts 32 "
         "--no-progress")
WORKERS = 3
RUN_TIMEOUT = 600
OK, WARNING, ERROR = "ok", "warning", "error"


# ----------------------------------------------------------------------------- running the workflow


def pyflyte(storage_root: str, run_id: str, num_rollout: int, segment_steps: int = 0) -> tuple[int, str, float]:
    """(exit status, console, seconds) of `pyflyte run` of the embedded default on this run."""
    ray_tmp = tempfile.mkdtemp(prefix="md", dir="/tmp")  # short: Ray's unix sockets live under it
    # COLUMNS: flytekit prints a failed task's error through rich, wrapped at the terminal's width
    env = dict(os.environ, RAY_DEDUP_LOGS="0", PYTHONUNBUFFERED="1", RAY_TMPDIR=ray_tmp, COLUMNS="2000")
    cmd = [PYFLYTE, "run", "workflows/fully_async.py", "fully_async_rl", "--storage_root", storage_root,
           "--flags", f"{FLAGS} --num-rollout {num_rollout} --run-id {run_id}", "--segment_steps", str(segment_steps)]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        console, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_everything_under(ray_tmp, proc)  # its own processes only: its session and its private Ray
        console, _ = proc.communicate()
        console += f"\n[killed after {RUN_TIMEOUT} s]"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return proc.returncode, console, time.monotonic() - started


def miles(*args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `miles ARGS` in this process; a traceback fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(list(args))
        except Exception:  # noqa: BLE001 - a bug: the command would print a traceback
            return -1, out.getvalue(), traceback.format_exc()
    return status, out.getvalue(), err.getvalue()


def miles_subprocess(*args: str) -> tuple[int, str]:
    proc = subprocess.run([MILES, *args], capture_output=True, text=True, timeout=SLOW_COMMAND_SECONDS)
    return proc.returncode, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- the templates


@dataclass
class Template:
    """A run after its first segment of STEPS steps, and what the independent reader says it holds."""

    backend: str
    storage_root: str
    run_uri: str
    objects: dict[str, list[str]]  # "writer/seq" -> its group ids
    consumed: dict[int, list[str]]  # step -> the groups it trained
    counts: dict  # `miles buffer inspect`

    @property
    def trained(self) -> set[str]:
        return {gid for ids in self.consumed.values() for gid in ids}

    def object_keys(self, *, consumed: bool) -> list[str]:
        """Group object keys (in commit order) whose groups were all consumed, or none of them."""
        keep = [k for k, ids in self.objects.items()
                if (all(g in self.trained for g in ids) if consumed else not set(ids) & self.trained)]
        return [f"buffer/groups/{k}.arrow" for k in keep]


def make_template(backend: str, storage_root: str, local: Path) -> Template:
    # a segment of a longer run: its producer runs ahead, so objects no step consumed stay in the buffer
    # (a run's last segment starts no group its steps will not train)
    status, console, seconds = pyflyte(storage_root, "template", MORE, segment_steps=STEPS)
    assert status == 0, f"the template run failed ({status}):\n{console[-8000:]}"
    print(f"[damaged-roots] {backend} template: {seconds:.0f} s")
    run_uri = f"{storage_root}/runs/template"
    run = mirror(Store(run_uri), local)
    objects = checker.read_objects(run)[0]
    consumed = {s: m["consumed"] for s, m in checker.read_manifests(run).items()}
    assert sorted(consumed) == list(range(STEPS)), consumed
    return Template(backend, storage_root, run_uri, objects, consumed, inspect_buffer(run_uri))


def mirror(store: Store, dest: Path) -> Path:
    """The run root's files the checker reads, as a local directory (a file:// root is read where it is)."""
    local = store.local_path()
    if local is not None:
        return Path(local)
    shutil.rmtree(dest, ignore_errors=True)
    keys = [k for k in store.list("") if k.split("/", 1)[0] in ("STATUS.json", "buffer", "checkpoints")]
    with ThreadPoolExecutor(16) as pool:
        for key, data in zip(keys, pool.map(store.get_bytes, keys)):
            (dest / key).parent.mkdir(parents=True, exist_ok=True)
            (dest / key).write_bytes(data)
    return dest


def copy_run(src: Store, dst: Store) -> None:
    if src.local_path() is not None:
        shutil.copytree(src.local_path(), dst.local_path())
        return
    keys = src.list("")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: dst.put_bytes(k, src.get_bytes(k)), keys))


# ----------------------------------------------------------------------------- the damage


@dataclass
class Damage:
    key: str  # the damaged file (or directory), relative to the run root
    destroyed: set[str] = field(default_factory=set)  # groups the damage itself removed
    originals: dict[str, bytes] = field(default_factory=dict)  # what the checker reads instead (a lost record)


def truncate(store: Store, key: str) -> bytes:
    raw = store.get_bytes(key)
    store.put_bytes(key, raw[:len(raw) // 2])
    return raw


def status_empty(s: Store, t: Template) -> Damage:
    s.put_bytes("STATUS.json", b"")
    return Damage("STATUS.json")


def status_missing(s: Store, t: Template) -> Damage:
    s.delete("STATUS.json")
    return Damage("STATUS.json")


def config_garbage(s: Store, t: Template) -> Damage:
    s.put_bytes("config.json", b"\x00\x9c garbage {")
    return Damage("config.json")


def latest_to_a_missing_step(s: Store, t: Template) -> Damage:
    s.put_bytes("checkpoints/LATEST", b"step_00000009")
    return Damage("checkpoints/LATEST")


def model_truncated(s: Store, t: Template) -> Damage:
    truncate(s, "checkpoints/step_00000003/model.safetensors")
    return Damage("checkpoints/step_00000003")


def model_missing(s: Store, t: Template) -> Damage:
    s.delete("checkpoints/step_00000003/model.safetensors")
    return Damage("checkpoints/step_00000003")


def complete_old_format(s: Store, t: Template) -> Damage:
    s.put_bytes("checkpoints/step_00000003/COMPLETE", b"")  # an older version's marker: empty
    return Damage("checkpoints")


def interrupted_save(s: Store, t: Template) -> Damage:
    """A save of step 5 that died before its COMPLETE (newer than the newest complete checkpoint)."""
    for key in s.list("checkpoints/step_00000003/"):
        if not key.endswith("/COMPLETE"):
            s.put_bytes(key.replace("step_00000003", "step_00000005"), s.get_bytes(key))
    return Damage("checkpoints/step_00000005")


def orphaned_checkpoint(s: Store, t: Template) -> Damage:
    """An extra step directory without COMPLETE, older than the newest complete checkpoint."""
    for key in s.list("checkpoints/step_00000001/"):
        if not key.endswith("/COMPLETE"):
            s.put_bytes(key.replace("step_00000001", "step_00000000"), s.get_bytes(key))
    return Damage("checkpoints/step_00000000")


def covered_manifest_truncated(s: Store, t: Template) -> Damage:
    key = "buffer/consumed/00000001.json"
    return Damage(key, originals={key: truncate(s, key)})


def compaction_garbage(s: Store, t: Template) -> Damage:
    key = "buffer/compacted/upto_00000003.json"
    s.put_bytes(key, b"{\"through_step\": 3, \"objects_done\": ")
    return Damage(key)


def unconsumed_object_deleted(s: Store, t: Template) -> Damage:
    """An object none of whose groups was consumed, deleted before a later object of its writer (a gap)."""
    keys = t.object_keys(consumed=False)
    later = [k for k in keys if any(o.startswith(k.rsplit("/", 1)[0]) and o > k for o in s.list("buffer/groups/"))]
    assert later, f"the template has no unconsumed object before another of its writer: {t.objects}"
    key = later[0]
    s.delete(key)
    return Damage(key, destroyed=set(t.objects[key[len("buffer/groups/"):-len(".arrow")]]))


def unconsumed_object_truncated(s: Store, t: Template) -> Damage:
    key = t.object_keys(consumed=False)[-1]
    truncate(s, key)
    return Damage(key, destroyed=set(t.objects[key[len("buffer/groups/"):-len(".arrow")]]))


def consumed_object_duplicated(s: Store, t: Template) -> Damage:
    """A consumed object's bytes again as another writer's object (a restore into the wrong prefix). Its writer
    sorts first, so the continuation meets it before the template's backlog (a copy under its own writer's next
    seq would sort after the backlog, which two more steps do not drain)."""
    key = t.object_keys(consumed=True)[0]
    dup = "buffer/groups/w0000000000000-restored/000000000000.arrow"
    s.put_bytes(dup, s.get_bytes(key))
    return Damage(dup)


def extra_file_in_groups(s: Store, t: Template) -> Damage:
    """A consumed object's bytes again under a name that is not a group object's (a copy left by hand)."""
    key = t.object_keys(consumed=True)[0]
    extra = key.replace(".arrow", ".copy.arrow")
    s.put_bytes(extra, s.get_bytes(key))
    return Damage(extra)


def lease_garbage(s: Store, t: Template) -> Damage:
    s.put_bytes("LEASE.json", b"<html>503 Service Unavailable</html>")
    return Damage("LEASE.json")


def orphaned_temporary(s: Store, t: Template) -> Damage:
    key = "buffer/consumed/00000002.json.tmp-0f1e2d3c"
    s.put_bytes(key, b"{\"step\": 2, \"consu")
    return Damage(key)


def eval_result_garbage(s: Store, t: Template) -> Damage:
    key = "eval/step_00000003/heldout.json"
    s.put_bytes(key, b"\x00\x00\x00")
    return Damage(key)


# ----------------------------------------------------------------------------- the cases


RESUMES, FALLS_BACK, REFUSED = "resumes", "falls back to step 1", "refused"


@dataclass(frozen=True)
class Case:
    backend: str
    damage: Callable[[Store, Template], Damage]
    finding: tuple[str, str]  # doctor's (kind, severity) for the damaged key
    outcome: str  # RESUMES, FALLS_BACK or REFUSED
    says: tuple[str, ...] = ()  # what the refusal (or, for a fallback, the console) says
    repair: bool = False  # refused: `miles doctor --repair` repairs it, and the run then continues

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.damage.__name__.replace('_', '-')}"


CASES = [
    Case("s3", status_empty, ("status", WARNING), RESUMES),
    Case("file", status_missing, ("status", WARNING), RESUMES),
    Case("file", config_garbage, ("config", ERROR), REFUSED, ("config.json", "Restore it from a backup")),
    Case("s3", latest_to_a_missing_step, ("latest", WARNING), RESUMES),
    Case("s3", model_truncated, ("checkpoint", WARNING), FALLS_BACK, ("step_00000003", "does not verify")),
    Case("file", model_missing, ("checkpoint", WARNING), FALLS_BACK, ("step_00000003", "missing file model")),
    Case("s3", complete_old_format, ("checkpoints", OK), RESUMES),
    Case("file", interrupted_save, ("checkpoint", OK), RESUMES),
    Case("s3", orphaned_checkpoint, ("orphaned-checkpoint", WARNING), RESUMES),
    Case("file", covered_manifest_truncated, ("manifest", WARNING), RESUMES),
    Case("s3", compaction_garbage, ("compaction", ERROR), REFUSED, ("upto_00000003.json", "--repair"), repair=True),
    Case("file", unconsumed_object_deleted, ("lost-object", WARNING), RESUMES),
    Case("s3", unconsumed_object_truncated, ("group-object", WARNING), RESUMES),
    Case("file", consumed_object_duplicated, ("duplicate-groups", WARNING), RESUMES),
    Case("s3", extra_file_in_groups, ("stray-file", WARNING), RESUMES),
    Case("file", lease_garbage, ("lease", ERROR), REFUSED, ("LEASE.json", "--repair"), repair=True),
    Case("s3", orphaned_temporary, ("temporary", WARNING), RESUMES),
    Case("file", eval_result_garbage, ("eval-result", WARNING), RESUMES),
]


# Resuming cases continued together (by backend; damages of different files, none masking another's outcome).
BUNDLES = {
    "file-a": ("file-status-missing", "file-covered-manifest-truncated", "file-eval-result-garbage"),
    "file-b": ("file-interrupted-save", "file-unconsumed-object-deleted", "file-consumed-object-duplicated"),
    "s3-a": ("s3-status-empty", "s3-complete-old-format", "s3-extra-file-in-groups", "s3-orphaned-temporary"),
    "s3-b": ("s3-latest-to-a-missing-step", "s3-orphaned-checkpoint", "s3-unconsumed-object-truncated"),
}
BUNDLE_OF = {case_id: name for name, ids in BUNDLES.items() for case_id in ids}


def _param(case: Case):
    return pytest.param(case, id=case.id, marks=[pytest.mark.s3] if case.backend == "s3" else [])


# ----------------------------------------------------------------------------- one case, prepared and continued


@dataclass
class Prepared:
    case: Case
    run_uri: str
    damage: Damage
    committed: set[str]  # every group committed before the damage
    doctor: tuple[int, dict]
    readers: dict[str, tuple[int, str, str]]
    base: dict  # the template's `miles buffer inspect`
    seconds: float


@dataclass
class Continued:
    status: int
    console: str
    seconds: float
    repair: tuple[int, str] | None = None  # `miles doctor --repair` after a refusal
    after_repair: tuple[int, str, float] | None = None
    problems: list[str] | None = None  # the checker's, once the run finished


def damaged_copy(t: Template, name: str, damages: list[Callable[[Store, Template], Damage]]) -> tuple[str, list[Damage]]:
    """(run uri, what each did) of a new copy of the template with `damages` applied in order."""
    run_uri = f"{t.storage_root}/runs/{name}-{uuid.uuid4().hex[:6]}"
    store = Store(run_uri)
    copy_run(Store(t.run_uri), store)
    return run_uri, [damage(store, t) for damage in damages]


def prepare(case: Case, t: Template, scratch: Path) -> Prepared:
    started = time.monotonic()
    run_uri, (damage,) = damaged_copy(t, case.damage.__name__.replace('_', '-'), [case.damage])
    committed = {gid for ids in t.objects.values() for gid in ids}
    status, out, err = miles("doctor", run_uri, "--json")
    assert status in (0, 1), f"miles doctor failed ({status}): {err}"
    group = t.consumed[2][0]
    readers = {"runs show": miles("runs", "show", run_uri, "--json"),
               "buffer inspect": miles("buffer", "inspect", run_uri),
               "lineage": miles("lineage", run_uri, group, "--json")}
    return Prepared(case, run_uri, damage, committed, (status, json.loads(out)), readers, t.counts,
                    time.monotonic() - started)


def bundled(bundle: str, prepared: list[Prepared], t: Template) -> Prepared:
    """One copy of the template holding the damage of every case in `prepared` (the first case stands for
    them in what the continuation checks: it resumes, and the checker's findings are clean less what any of
    the damages destroyed)."""
    run_uri, damages = damaged_copy(t, bundle, [p.case.damage for p in prepared])
    merged = Damage(", ".join(d.key for d in damages), set().union(*(d.destroyed for d in damages)),
                    {k: v for d in damages for k, v in d.originals.items()})
    first = prepared[0]
    return Prepared(first.case, run_uri, merged, first.committed, first.doctor, first.readers, first.base, 0.0)


def continue_run(p: Prepared, t: Template, scratch: Path) -> Continued:
    run_id = p.run_uri.rsplit("/", 1)[1]
    got = Continued(*pyflyte(t.storage_root, run_id, MORE))
    if got.status != 0 and p.case.repair:
        got.repair = miles_subprocess("doctor", p.run_uri, "--repair")
        got.after_repair = pyflyte(t.storage_root, run_id, MORE)
    if got.status == 0 or (got.after_repair and got.after_repair[0] == 0):
        run = mirror(Store(p.run_uri), scratch / run_id)
        with restored(run, p.damage.originals):
            got.problems = checker.check(run, MORE, BATCH, p.committed - p.damage.destroyed)
    return got


@contextlib.contextmanager
def restored(run: Path, originals: dict[str, bytes]):
    """The records the damage destroyed put back for the checker (what a backup holds), then the damaged ones."""
    saved = {key: (run / key).read_bytes() for key in originals if (run / key).exists()}
    for key, data in originals.items():
        (run / key).write_bytes(data)
    try:
        yield
    finally:
        for key, data in saved.items():
            (run / key).write_bytes(data)


# ----------------------------------------------------------------------------- fixtures


def _selected(request) -> list[Case]:
    here = request.module.__name__
    return [item.callspec.params["case"] for item in request.session.items
            if item.module.__name__ == here and "case" in getattr(getattr(item, "callspec", None), "params", {})]


@pytest.fixture(scope="module")
def continued(request, tmp_path_factory) -> dict[str, tuple[Prepared | Exception, Future | None]]:
    """Every selected case prepared (copied, damaged, checked by doctor and the readers) and its
    continuation running in the pool: case id -> (Prepared, Future[Continued])."""
    cases = _selected(request)
    scratch = tmp_path_factory.mktemp("damaged")
    roots = {"file": f"file://{scratch / 'store'}"}
    if any(c.backend == "s3" for c in cases):
        roots["s3"] = f"s3://{request.getfixturevalue('s3_bucket')}/damaged-{uuid.uuid4().hex[:8]}"
    backends = sorted({c.backend for c in cases})
    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        made = {b: pool.submit(make_template, b, roots[b], scratch / f"template-{b}") for b in backends}
        templates = {b: f.result() for b, f in made.items()}
    print(f"[damaged-roots] templates: {time.monotonic() - started:.0f} s")
    pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="continue")
    out = {}
    bundles: dict[str, list[Prepared]] = {}
    try:
        for case in cases:
            t = templates[case.backend]
            try:
                p = prepare(case, t, scratch)
            except Exception as e:  # noqa: BLE001 - that case's test fails with it; the others go on
                out[case.id] = (e, None)
                continue
            if case.id in BUNDLE_OF:
                bundles.setdefault(BUNDLE_OF[case.id], []).append(p)
                continue
            out[case.id] = (p, pool.submit(continue_run, p, t, scratch))
        for name, prepared in bundles.items():
            t = templates[prepared[0].case.backend]
            try:
                future = pool.submit(continue_run, bundled(name, prepared, t), t, scratch)
            except Exception as e:  # noqa: BLE001 - the bundle's tests fail with it
                out.update({p.case.id: (e, None) for p in prepared})
                continue
            out.update({p.case.id: (p, future) for p in prepared})
        yield out
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------------------- the test


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_a_damaged_run_root_resumes_or_is_refused_by_name(case, continued):
    p, future = continued[case.id]
    if isinstance(p, Exception):
        raise p
    finding = check_doctor(p)
    check_readers(p)
    got = future.result(timeout=LONG_RUN_SECONDS)
    print(f"[damaged-roots] {case.id}: prepared in {p.seconds:.1f} s, continued in {got.seconds:.0f} s"
          + (f", again after repair in {got.after_repair[2]:.0f} s" if got.after_repair else "")
          + f"; doctor: {finding['severity']} {finding['kind']}: {finding['what'][:160]}")
    if case.outcome == REFUSED:
        check_refused(p, got)
        if not case.repair:
            return
        status, console, _ = got.after_repair
        assert status == 0, f"the repaired run root did not continue ({status}):\n{console[-6000:]}"
    else:
        assert got.status == 0, f"the continuation failed ({got.status}):\n{got.console[-8000:]}"
        for words in case.says:
            assert words in got.console, f"the console does not say {words!r}:\n{got.console[-4000:]}"
    assert got.problems == [], got.problems


def check_refused(p: Prepared, got: Continued) -> None:
    """Refused: a failed execution whose console names the damaged file and the fix."""
    assert got.status != 0, f"a run root with {p.damage.key} damaged was continued:\n{got.console[-4000:]}"
    said = got.console.replace("\n", "")  # a message wrapped by rich all the same
    for words in p.case.says:
        assert words in said, f"the refusal does not say {words!r}:\n{got.console[-6000:]}"
    if p.case.repair:
        status, text = got.repair
        assert status == 0, f"`miles doctor --repair` left an error ({status}):\n{text}"


def check_doctor(p: Prepared) -> dict:
    """Doctor's finding for the damaged key (its kind and severity as the case expects; exit 1 exactly when it
    reports an error, and only this case's errors)."""
    status, report = p.doctor
    kind, severity = p.case.finding
    store = Store(p.run_uri)
    named = [f for f in report["findings"] if f["key"].rstrip("/") == store.uri(p.damage.key).rstrip("/")
             and (f["kind"], f["severity"]) == (kind, severity)]
    assert named, f"doctor has no {severity} {kind} finding for {p.damage.key}: {json.dumps(report, indent=1)}"
    assert status == (1 if report["errors"] else 0), (status, report["errors"])
    assert bool(report["errors"]) == (severity == ERROR), json.dumps(report["findings"], indent=1)
    return named[0]


def check_readers(p: Prepared) -> None:
    """Each reader exits 0 with the right counts, or 1 with one line naming the damaged file; no traceback."""
    for name, (status, out, err) in p.readers.items():
        assert status in (0, 1) and "Traceback" not in err, f"`miles {name}` crashed ({status}):\n{err}"
        if status == 1:  # one line `miles COMMAND: Error: ...` (after any warnings logged) naming the file
            said = [line for line in err.splitlines() if line.startswith("miles ")]
            assert len(said) == 1 and p.damage.key.rsplit("/", 1)[-1] in said[0], \
                f"`miles {name}` failed without naming {p.damage.key}: {err}"
    status, out, _ = p.readers["lineage"]
    if status == 0:
        assert json.loads(out)["fate"] == {"step": 2, "outcome": "consumed"}, out
    status, out, _ = p.readers["buffer inspect"]
    assert status == 0
    check_counts(json.loads(out), p)
    status, out, _ = p.readers["runs show"]
    if status == 0:
        shown = json.loads(out)
        check_counts(shown["buffer"], p)
        assert shown["status"] is not None and shown["status"]["last_step"] == STEPS - 1, shown["status"]


def check_counts(b: dict, p: Prepared) -> None:
    """The template's counts, less the groups the damage destroyed; what cannot be counted is named."""
    base, lost = p.base, len(p.damage.destroyed)
    assert b["committed"] == base["committed"] - lost, (b, base)
    assert b["available"] == base["available"] - lost, (b, base)
    taken = b["consumed"] + b["consumed_or_rejected_unattributed"]
    assert taken == base["consumed"] + base["consumed_or_rejected_unattributed"], (b, base)
    assert b["undecodable_objects"] == (1 if p.case.damage is unconsumed_object_truncated else 0), b


def test_a_bundle_holds_only_cases_that_resume_without_a_console_check():
    """A bundle's continuation stands for each of its cases only where the case expects what the bundle
    checks: that the run resumes, and the checker's findings."""
    by_id = {c.id: c for c in CASES}
    assert set(BUNDLE_OF) <= set(by_id), set(BUNDLE_OF) - set(by_id)
    assert all(by_id[i].outcome == RESUMES and not by_id[i].says for i in BUNDLE_OF)
    assert all(len({by_id[i].backend for i in ids}) == 1 for ids in BUNDLES.values())
