"""Custom generate functions: agentic multi-turn episodes in place of one engine call (docs/agentic.md).

`--custom-generate-function-path module:fn` names the slime/miles slot

    async def fn(args, sample, sampling_params[, evaluation=False]) -> Sample | list[Sample]

which the producer awaits once per sample instead of one `/generate` call (eval awaits it with
`evaluation=True` when `fn` takes that keyword). The function owns the whole episode: it calls the
engines through `args.engine` (the run's `EngineClient`, load-balanced over every engine: the
engine with the fewest requests in flight from this client serves each call), runs its
environment or tools between turns, and builds the response in `sample`:

- model tokens: `append_generated(sample, result)` appends an engine result with loss_mask 1, the
  engine's log-probs and the weight version of every token, and sets `status`/`finish_reason`;
- environment/tool tokens: `append_environment(sample, ids)` appends them with loss_mask 0 and
  rollout log-prob 0 (the engine never scored them; the trainer multiplies every loss term by the
  mask, so their log-probs and logits do not matter);
- `reward`: left None, the configured reward (`--custom-rm-path` or the dataset's) scores the
  sample; set, it is kept.

The producer holds the sample's submission credit for the whole episode, so an episode of many
turns counts once against `--async-max-concurrent-samples`. Weight updates during an episode pause
and resume its engine calls like any other request; tokens after the update carry the new version
(the sample is then mixed-version, counted by `rollout/weight_version/mixed_version_ratio`).

What this module owns: resolving and signature-checking the function, the `args` handed in, the
append helpers, and checking what the function returns. A failure (an exception from the function,
or a result that breaks the contract) is a `GenerateFunctionError` naming the function; the
producer turns it into a failed group (never a failed worker).
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Any

from miles_core.config.plugins import PluginError, load_plugin
from miles_core.models.source import tokenizer_source
from miles_core.models.tokenizer import load_tokenizer
from miles_core.samples import Sample, SampleStatus

FLAG = "--custom-generate-function-path"
SIGNATURE = "async def fn(args, sample, sampling_params[, evaluation=False]) -> Sample | list[Sample]"
_FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


class GenerateFunctionError(RuntimeError):
    """A custom generate function raised, or returned something that breaks its contract."""

    def __init__(self, message: str):
        super().__init__(message)


@dataclass
class GenerateArgs:
    """The `args` a custom generate function receives.

    `engine`: the engine client (`await args.engine.generate(input_ids, sampling_params)` returns a
    `GenerateResult`: output_ids, output_logprobs, token_versions, finish_reason). `config`: the run's
    `RunConfig` (None in tests). `tokenizer()`: the run's model tokenizer, loaded on first use (text
    agents encode tool results with it). For code written against miles' `args`, any flag's field
    name reads through to the config: `args.rollout_max_response_len`.
    """

    engine: Any
    config: Any = None
    text_tokenizer: Any = None  # set in tests; else loaded from the config by tokenizer()

    def tokenizer(self) -> Any:
        if self.text_tokenizer is None:
            if self.config is None:
                raise GenerateFunctionError("GenerateArgs.tokenizer(): no config to load the model's tokenizer from")

            self.text_tokenizer = load_tokenizer(tokenizer_source(self.config))
        return self.text_tokenizer

    def __getattr__(self, name: str) -> Any:
        config = self.__dict__.get("config")
        if config is not None and not name.startswith("_"):
            for section in vars(config).values():
                if hasattr(section, "__dataclass_fields__") and name in section.__dataclass_fields__:
                    return getattr(section, name)
        raise AttributeError(f"GenerateArgs has no attribute {name!r} (it holds engine, config, tokenizer() "
                             "and the config's flag fields)")


class GenerateFunction:
    """A resolved, signature-checked custom generate function; calling it runs one episode."""

    def __init__(self, fn: Any, path: str, timeout_seconds: float | None = None):
        self.fn, self.path = fn, path
        self.timeout_seconds = timeout_seconds  # `--custom-generate-timeout-seconds`; None: wait for ever
        target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", fn)
        if not inspect.iscoroutinefunction(target):
            raise PluginError(f"{FLAG}={path!r}: {getattr(fn, '__name__', fn)!r} is not an async function; "
                              f"expected {SIGNATURE}.")
        sig = inspect.signature(fn)
        try:
            sig.bind(None, None, None)
        except TypeError as e:
            raise PluginError(f"{FLAG}={path!r}: {getattr(fn, '__name__', fn)}{sig} cannot be called as "
                              f"fn(args, sample, sampling_params) ({e}); expected {SIGNATURE}.") from e
        params = sig.parameters.values()
        self.accepts_evaluation = any(p.name == "evaluation" or p.kind == p.VAR_KEYWORD for p in params)

    async def __call__(self, args: GenerateArgs, sample: Sample, sampling_params: dict,
                       evaluation: bool = False) -> list[Sample]:
        """One episode: the samples it produced (checked), or GenerateFunctionError naming the function."""
        kwargs = {"evaluation": True} if evaluation and self.accepts_evaluation else {}
        out = await self._within_timeout(self.fn(args, sample, dict(sampling_params), **kwargs))
        samples = out if isinstance(out, list) else [out]
        if not samples:
            raise GenerateFunctionError(f"{FLAG} {self.path} returned an empty list; return the sample")
        for s in samples:
            self._check(s, sample)
        return samples

    async def _within_timeout(self, episode) -> Any:
        """The episode's result; its exception, or its not returning within the timeout (the episode is
        then cancelled), as a GenerateFunctionError naming the function."""
        deadline = asyncio.timeout(self.timeout_seconds)
        try:
            async with deadline:
                return await episode
        except Exception as e:  # noqa: BLE001 - re-raised with the function's name, cause chained
            if isinstance(e, TimeoutError) and deadline.expired():
                raise GenerateFunctionError(f"{FLAG} {self.path} did not return within {self.timeout_seconds:g} s "
                                            "(--custom-generate-timeout-seconds); its episode was cancelled") from None
            raise GenerateFunctionError(f"{FLAG} {self.path} raised {type(e).__name__}: {e}") from e

    def _check(self, s: Any, original: Sample) -> None:
        where = f"{FLAG} {self.path}"
        if not isinstance(s, Sample):
            raise GenerateFunctionError(f"{where} returned {type(s).__name__}, not a miles_core.samples.Sample")
        s.group_id, s.prompt_index = original.group_id, original.prompt_index
        fill_environment_versions(s)
        n = len(s.response_ids)
        for name in ("response_logprobs", "loss_mask", "token_versions"):
            if len(getattr(s, name)) != n:
                raise GenerateFunctionError(
                    f"{where}: sample {s.group_id}/{s.sample_index} has {len(getattr(s, name))} {name} for {n} "
                    "response tokens; append tokens with append_generated / append_environment")
        if any(m not in (0, 1) for m in s.loss_mask):
            raise GenerateFunctionError(f"{where}: loss_mask entries must be 0 or 1")
        if s.status == SampleStatus.PENDING:
            raise GenerateFunctionError(f"{where}: sample {s.group_id}/{s.sample_index} came back with status "
                                        "pending; set status (append_generated sets it from the finish reason)")


_UNKNOWN_VERSION = -1


def append_generated(sample: Sample, result: Any) -> None:
    """Append one engine result (a turn of the model) to the sample's response: loss_mask 1, the
    engine's log-probs, the weight version of each token; status and finish_reason from this turn
    (an aborted turn makes the sample aborted)."""
    ids = [int(t) for t in result.output_ids]
    lps = [float(x) for x in (result.output_logprobs or [])]
    versions = [int(v) for v in (getattr(result, "token_versions", None) or [])]
    if len(lps) != len(ids):
        lps = (lps + [0.0] * len(ids))[:len(ids)]
    if len(versions) != len(ids):
        v = getattr(result, "weight_version", None)
        versions = [int(v) if v is not None else 0] * len(ids)
    sample.response_ids += ids
    sample.response_logprobs += lps
    sample.loss_mask += [1] * len(ids)
    sample.token_versions += versions
    sample.finish_reason = str(result.finish_reason)
    sample.status = _FINISH_STATUS.get(sample.finish_reason, SampleStatus.ABORTED)


def append_environment(sample: Sample, token_ids: list[int]) -> None:
    """Append environment/tool tokens: loss_mask 0 and rollout log-prob 0. They carry the version
    of the model token before them (the weights whose action they answer), so they neither make a
    sample mixed-version nor look stale."""
    ids = [int(t) for t in token_ids]
    version = sample.token_versions[-1] if sample.token_versions else _UNKNOWN_VERSION
    sample.response_ids += ids
    sample.response_logprobs += [0.0] * len(ids)
    sample.loss_mask += [0] * len(ids)
    sample.token_versions += [version] * len(ids)


def fill_environment_versions(sample: Sample) -> None:
    """Environment tokens appended before any model token get the first model token's version."""
    known = [v for v in sample.token_versions if v != _UNKNOWN_VERSION]
    if len(known) != len(sample.token_versions):
        first = known[0] if known else 0
        sample.token_versions = [first if v == _UNKNOWN_VERSION else v for v in sample.token_versions]


def load_generate_function(path: str, timeout_seconds: float | None = None) -> GenerateFunction | None:
    """`--custom-generate-function-path` resolved and checked (None when unset); PluginError names the flag."""
    if not path:
        return None
    return GenerateFunction(load_plugin(path, FLAG), path, timeout_seconds)
