"""Reward functions: the built-ins, the `--custom-rm-path` slot, and scoring a group safely.

A reward function is one of (checked when the `Rewarder` is built, before any generation):

    fn(sample) -> float                      per sample; may be `async def`
    fn(sample, text) -> float                per sample, with `fn.needs_text = True`: text is the
                                             decoded response (the producer's tokenizer)
    fn(samples) -> list[float]               per group (batched), with `fn.batched = True`;
    fn(samples, texts) -> list[float]        ... and `needs_text = True`; either may be async; an entry
                                             that is an exception fails that sample only

`signature_problem(fn)` is the check (validation runs it before a run starts): the function takes
N = 2 positional arguments with `needs_text`, else 1: at least N positional parameters (or *args),
at most N of them without a default, and no keyword-only parameter without a default.
`BUILTIN_REWARD_TASKS` are the tasks `task_reward` scores.

Built-ins (usable as `--custom-rm-path miles_core.rollout.rewards:NAME`):
    task_reward   the default: dispatches on the sample's task (metadata "task"): reverse4/copy4 ->
                  `builtin_tasks.digits_reward`, exact_match -> exact_match, math -> math_answer,
                  arith -> `arith.arith_reward` (the integer after the first "=", else the last one)
    exact_match   1.0 when the stripped response equals the label, else 0.0
    math_answer   1.0 when the answer (last `\\boxed{...}`, else the last number) equals the label's
                  number, else 0.0

A reward function that raises (or returns a non-number) does not stop the run: that sample is
marked `failed`, its reward stays None, its loss mask is zeroed and the reason goes into its
metadata (`reward_error`); the count is reported as `rollout/reward_failed`, the console summarises
repeats (`failures.FailureTally`), and a run where more than --max-failed-sample-fraction of the
samples fail over --failed-sample-window-steps steps fails (`failures.FailureBudget`).

Scoring never runs user code on the caller's event loop (the rollout actor's loop, which also
submits new groups and commits finished ones; see `reward_workers`): decoding and a sync reward
function run on the Rewarder's bounded thread pool (several at once: a sync reward must be
thread-safe), an `async def` reward on the Rewarder's own event-loop thread (so it must not await
objects bound to the caller's loop). `Rewarder.close()` stops those threads.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import re
import weakref
from typing import Any, Callable

from miles_core.config.plugins import load_plugin
from miles_core.rollout.failures import FailureTally
from miles_core.rollout.arith import arith_reward
from miles_core.rollout.builtin_tasks import digits_reward
from miles_core.rollout.reward_workers import RewardWorkers
from miles_core.samples import Group, Sample, SampleStatus

log = logging.getLogger(__name__)

Decode = Callable[[list[int]], str]


class RewardError(ValueError):
    def __init__(self, message: str):
        super().__init__(message)


# ----------------------------------------------------------------------------- built-ins


def _meta(sample: Sample) -> dict:
    try:
        meta = json.loads(sample.metadata or "{}")
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


def exact_match(sample: Sample, text: str) -> float:
    return float(text.strip() == sample.label.strip())


exact_match.needs_text = True

_BOXED = re.compile(r"\\boxed\s*\{")
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")


def extract_math_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (balanced braces), else the last number in the text."""
    boxed = list(_BOXED.finditer(text))
    if boxed:
        start = boxed[-1].end()
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
        return None  # unbalanced: no answer
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> float | None:
    t = text.strip().strip("$").replace(",", "").replace(" ", "")
    t = re.sub(r"^\\(?:text|mathrm)\{(.*)\}$", r"\1", t)
    frac = re.fullmatch(r"\\d?frac\{([-+]?[\d.]+)\}\{([-+]?[\d.]+)\}", t)
    try:
        if frac:
            return float(frac.group(1)) / float(frac.group(2))
        if re.fullmatch(r"[-+]?[\d.]+/[\d.]+", t):
            a, b = t.split("/")
            return float(a) / float(b)
        return float(t)
    except (ValueError, ZeroDivisionError):
        return None


def math_answer(sample: Sample, text: str) -> float:
    answer = extract_math_answer(text)
    if answer is None:
        return 0.0
    label = extract_math_answer(sample.label) or sample.label
    a, b = _as_number(answer), _as_number(label)
    if a is not None and b is not None:
        return float(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9))
    return float(answer.replace(" ", "") == label.strip().replace(" ", ""))


math_answer.needs_text = True


BUILTIN_REWARD_TASKS = ("reverse4", "copy4", "exact_match", "math", "arith")  # what task_reward scores


def task_reward(sample: Sample, text: str) -> float:
    task = _meta(sample).get("task", "")
    if task in ("reverse4", "copy4"):
        return digits_reward(sample.response_ids, sample.label)
    if task == "exact_match":
        return exact_match(sample, text)
    if task == "math":
        return math_answer(sample, text)
    if task == "arith":
        return arith_reward(sample, text)
    raise RewardError(f"no built-in reward for task {task!r} (known: {', '.join(BUILTIN_REWARD_TASKS)}); "
                      "set --custom-rm-path module:function")


task_reward.needs_text = True


# ----------------------------------------------------------------------------- scoring


def load_reward(path: str, rm_type: str = "", rm_url: str = "", decode: Decode | None = None) -> Callable:
    """The run's reward: `--custom-rm-path` resolved and checked, else `--rm-type`'s
    (miles_core.rollout.rm_types; remote_rm: the reward model at `rm_url`, miles_core.rollout.remote_rm,
    its prompts decoded by `decode`), else the built-in `task_reward`."""
    if path:
        return load_plugin(path, "--custom-rm-path")
    if rm_type == "remote_rm":
        from miles_core.rollout.remote_rm import RemoteReward

        return RemoteReward(rm_url, decode or (lambda ids: " ".join(map(str, ids))))
    if rm_type:
        from miles_core.rollout.rm_types import rm_type_reward

        return rm_type_reward(rm_type)
    return task_reward


def signature_problem(fn: Callable, name: str | None = None) -> str | None:
    """Why `fn` (named `name` in the message: its --custom-rm-path) cannot be called as a reward
    function (see the module docstring), or None."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None  # a builtin without a readable signature: judged when it is called
    batched, needs_text = bool(getattr(fn, "batched", False)), bool(getattr(fn, "needs_text", False))
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    want = 2 if needs_text else 1
    required = [p for p in positional if p.default is p.empty]
    keyword_only = [p.name for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    if (varargs or (len(positional) >= want and len(required) <= want)) and not keyword_only:
        return None
    what = "samples" if batched else "sample"
    sig = f"({what}, text{'s' if batched else ''})" if needs_text else f"({what})"
    flags = ", ".join(a for a, on in (("batched=True", batched), ("needs_text=True", needs_text)) if on)
    declared = f" (it has {flags})" if flags else ""
    return (f"--custom-rm-path: {name or getattr(fn, '__name__', fn)!r} must take {sig}{declared} and no other "
            f"required argument; its signature is {inspect.signature(fn)}")


class Rewarder:
    """Scores groups with one reward function; never raises for a reward function's failure.

    `decode` turns response ids into text for functions with `needs_text`; without one, such a
    function gets the ids joined by spaces (enough for the digit tasks, wrong for real text).
    """

    def __init__(self, fn: Callable, decode: Decode | None = None, threads: int = 8,
                 timeout_seconds: float | None = None, tally: FailureTally | None = None):
        self.fn = fn
        self.tally = tally or FailureTally(log)  # tries and failures per window; the console's summary
        self.timeout_seconds = timeout_seconds  # `--reward-timeout-seconds`; None: wait for ever
        self.batched = bool(getattr(fn, "batched", False))
        self.needs_text = bool(getattr(fn, "needs_text", False))
        self.decode = decode or (lambda ids: " ".join(map(str, ids)))
        self.failed = 0  # samples whose reward failed, since the last take_failed()
        self._check_signature()
        self._workers = RewardWorkers(threads)
        # a Rewarder dropped without close() (eval scorers) still stops its threads
        self._finalizer = weakref.finalize(self, self._workers.close, 0.0)

    def _check_signature(self) -> None:
        problem = signature_problem(self.fn)
        if problem:
            raise RewardError(problem)

    async def score_group(self, group: Group) -> None:
        """Set `reward` on every sample of the group; mark failures (see the module docstring)."""
        # a reward already set (by a custom generate function) is kept
        samples = [s for s in group.samples
                   if s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) and s.reward is None]
        if not samples:
            return
        if self.batched:
            try:
                rewards = list(await self._evaluate(lambda: self._batch_args(samples)))
                if len(rewards) != len(samples):
                    raise RewardError(f"batched reward returned {len(rewards)} values for {len(samples)} samples")
            except Exception as e:  # noqa: BLE001 - a raising reward fails its samples, not the run
                for s in samples:
                    self._fail(s, e)
                return
            for s, r in zip(samples, rewards):
                if isinstance(r, BaseException):  # a batched reward may fail some of its samples only
                    self._fail(s, r)
                else:
                    self._set(s, r)
            return
        for s in samples:
            try:
                self._set(s, await self._evaluate(lambda s=s: self._sample_args(s)))
            except Exception as e:  # noqa: BLE001
                self._fail(s, e)

    def _batch_args(self, samples: list[Sample]) -> tuple:
        return (samples, [self.decode(s.response_ids) for s in samples]) if self.needs_text else (samples,)

    def _sample_args(self, sample: Sample) -> tuple:
        return (sample, self.decode(sample.response_ids)) if self.needs_text else (sample,)

    async def _evaluate(self, make_args: Callable[[], tuple]) -> Any:
        """`fn(*make_args())` off the caller's loop (see the module docstring). A TimeoutError the
        function raises itself is its own failure, not the timeout's."""
        deadline = asyncio.timeout(self.timeout_seconds)
        try:
            async with deadline:
                return await self._workers.call(self.fn, make_args)
        except TimeoutError:
            if not deadline.expired():
                raise
            name = getattr(self.fn, "__qualname__", repr(self.fn))
            raise RewardError(f"reward function {name} did not return within {self.timeout_seconds:g} s "
                              "(--reward-timeout-seconds); its thread is abandoned") from None

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker threads (a reward still running is abandoned after `timeout`). Idempotent;
        scoring afterwards fails the samples."""
        self._finalizer.detach()
        self._workers.close(timeout)

    def _set(self, sample: Sample, value) -> None:
        try:
            reward = float(value)
            if math.isnan(reward):
                raise ValueError("NaN")
        except (TypeError, ValueError) as e:
            self._fail(sample, RewardError(f"reward function returned {value!r}, not a number ({e})"))
            return
        self.tally.tried("reward")  # counted with its outcome, so a step's tally never holds one without it
        sample.reward = reward

    def _fail(self, sample: Sample, error: BaseException) -> None:
        self.failed += 1
        self.tally.tried("reward")
        reason = self.tally.failed("reward", error, f"{sample.group_id}/{sample.sample_index}")
        meta = _meta(sample)
        meta["reward_error"] = reason
        sample.metadata = json.dumps(meta, sort_keys=True)
        sample.status = SampleStatus.FAILED
        sample.reward = None
        sample.loss_mask = [0] * len(sample.response_ids)

    def take_failed(self) -> int:
        n, self.failed = self.failed, 0
        return n
