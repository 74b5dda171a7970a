"""Every command the docs show is one a reader can run: the shell blocks of docs/*.md and README.md.

Which lines are commands: in a ```console block, or an untagged one with `$ ` prompts, the `$` lines
(the lines after one are its output); in a ```bash / ```sh / ```shell block every line; in another
untagged block the lines that start with a program this project documents (`miles`, `pyflyte`,
`./dev`, `python`, ...). A trailing backslash joins lines, `#` starts a comment, and `NAME=value` words
before the program are its environment (an `export NAME=value` line sets it for the rest of the page).

What is checked, by program (a failure names the doc file and line):
- `pyflyte ... run [--remote] FILE WORKFLOW --input value ...`, and `./dev run ...` (its local
  `pyflyte run workflows/fully_async.py fully_async_rl ...`): FILE holds WORKFLOW and the workflow takes
  each input. For `fully_async_rl` the inputs become the run config as the first task builds it
  (`tasks.inputs.run_config`) and must pass `validate` on the cluster the run gets: with `--remote`
  the `train` task's Ray cluster (`tasks.cluster.train_cluster`, with the MILES_RAY_* values of the
  page's register command, else the defaults), otherwise a 2-CPU machine (the smallest the docs
  promise). A remote run has MILES_ENGINE_API_KEY when the page registers with
  MILES_ENGINE_API_KEY_SECRET (the secret every task then gets mounted), a local one when the
  command or the page sets it.
- every `miles` command the docs use: `miles COMMAND --help` exits 0.
- `miles validate FLAGS`: run; exit 0, or 2 when the doc shows the error it prints.
- `miles runs show|list`, `miles buffer inspect`, `miles engines show`, `miles report`, `miles lineage`,
  `miles doctor`: run on a small run root made here (the doc's run URI and group id replaced by the fixture's); exit 0.
- `miles engines add|remove RUN N`: run on a fresh run root of N + 1 engines (the reader's running run);
  exit 0 and the target it prints moved by N.
- `miles fork|replay RUN ... FLAGS`: FLAGS pass validation (the recorded run is the reader's); so do
  the lines of a block that lists bare flags (`--eval-interval 20`), taken together.
- `miles import-model import:NAME ...`: NAME is a packaged model.
- `pyflyte register|package`, `python FILE`, `bash FILE`, `python -m MODULE`: the file, directory or
  module (of this repository) exists.
Anything else (kubectl, flytectl, pip, a cluster) is the reader's environment and is not run.
The `flyte.config` snippet of docs/deployment.md is read by flytekit to the values it shows.
"""

from __future__ import annotations

import configparser
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from miles_core.buffer import DropUnused, DurableBuffer
from miles_core.cli import main as miles_main
from miles_core.config import ConfigError, embedded_default, parse_flags
from miles_core.models.source import PACKAGED
from miles_core.prepare.checks import model_problems, setting_warnings, validate
from miles_core.prepare.resources import ClusterShape, Node
from miles_core.storage import Store
from miles_core.storage.run_root import FINISHED, write_config, write_status
from tests.integration.test_buffer_durable import make_group
from tests.support.report_run import write_steps

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(ROOT.glob("docs/*.md")) + [ROOT / "README.md"]
SHELL_TAGS = {"bash", "sh", "shell"}
PROGRAMS = {"miles", "pyflyte", "./dev", "python", "python3", "bash", "pip", "flytectl", "kubectl"}
ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
ERROR_OUTPUT = ("invalid configuration", "unknown flag", "no run at", "Error", "error:")
REPO_PACKAGES = {"miles_core", "tasks", "workflows", "tests", "bench"}
LOCAL_MACHINE = ClusterShape((Node("this machine", 2, 0),), "a 2-CPU machine (the smallest the docs promise)")
DEFAULT_WORKFLOW = ["workflows/fully_async.py", "fully_async_rl"]
TOKEN_ENV, SECRET_ENV = "MILES_ENGINE_API_KEY", "MILES_ENGINE_API_KEY_SECRET"
UNPARSABLE = "<not a shell line>"


@dataclass
class Command:
    doc: str                     # path relative to the repository root
    line: int                    # 1-based line of the command's first line
    argv: list[str]              # program and arguments, environment words removed
    env: dict[str, str]          # NAME=value words before the program
    page_env: dict[str, str]     # what earlier commands on the page set: exports, register-time variables
    output: list[str] = field(default_factory=list)  # console blocks: the lines shown after the command

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def program(self) -> str:
        first = self.argv[0]
        return Path(first).name if first.startswith(".venv/bin/") else first

    def shows_error(self) -> bool:
        return any(marker in line for line in self.output for marker in ERROR_OUTPUT)


# ----------------------------------------------------------------------------- extraction


def _blocks(lines: list[str]):
    """(info string, [(line number, text)]) of every fenced block."""
    block, tag = None, ""
    for number, text in enumerate(lines, 1):
        fence = re.match(r"^\s*```(\S*)", text)
        if fence and block is None:
            block, tag = [], fence.group(1)
        elif fence:
            yield tag, block
            block = None
        elif block is not None:
            block.append((number, text))


def _joined(rows: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Lines continued by a trailing backslash joined into one, numbered by their first line."""
    out, pending, start = [], "", 0
    for number, text in rows:
        start = start if pending else number
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1] + " "
            continue
        out.append((start, pending + text))
        pending = ""
    return out + ([(start, pending)] if pending else [])


def _split(text: str) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(text, comments=True)
    env = {}
    while words and ENV_WORD.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def _looks_like_command(text: str) -> bool:
    """An untagged block's line that starts, unindented, with a program (indented lines are output)."""
    words = [w for w in text.split() if not ENV_WORD.match(w)]
    unindented = not text[:1].isspace()
    return unindented and bool(words) and (words[0] in PROGRAMS or words[0].startswith(".venv/bin/"))


def _console(rows: list[tuple[int, str]]) -> list[tuple[int, str, list[str]]]:
    """(line, command text, output lines) of each `$ ` prompt; continuation lines join the command."""
    sessions: list[tuple[int, str, list[str]]] = []
    rows = iter(rows)
    for number, text in rows:
        if text.startswith("$ "):
            command = text[2:]
            while command.rstrip().endswith("\\"):
                command = command.rstrip()[:-1] + " " + next(rows, (0, ""))[1]
            sessions.append((number, command, []))
        elif sessions:
            sessions[-1][2].append(text)
    return sessions


def _block_commands(tag: str, rows: list[tuple[int, str]]) -> list[tuple[int, str, list[str]]]:
    if tag == "console" or (tag == "" and any(t.startswith("$ ") for _, t in rows)):
        return _console(rows)
    if tag in SHELL_TAGS:
        return [(n, t, []) for n, t in _joined(rows)]
    if tag == "":
        return [(n, t, []) for n, t in _joined(rows) if _looks_like_command(t)]
    return []


def _flag_lines(found: list[tuple[int, str, list[str]]]) -> list[tuple[int, str, list[str]]]:
    """Consecutive lines of bare flags (`--eval-interval 20`), as in a block listing some, as one line."""
    out: list[tuple[int, str, list[str]]] = []
    for number, text, output in found:
        bare = text.lstrip().startswith("--")
        if bare and out and out[-1][1].lstrip().startswith("--"):
            out[-1] = (out[-1][0], out[-1][1] + " " + shlex.join(shlex.split(text, comments=True)), output)
        else:
            out.append((number, shlex.join(shlex.split(text, comments=True)) if bare else text, output))
    return out


def doc_commands(path: Path) -> list[Command]:
    """The commands of one page, in order, each with the environment the page set before it."""
    rel, page_env, commands = str(path.relative_to(ROOT)), {}, []
    for tag, rows in _blocks(path.read_text().splitlines()):
        for number, text, output in _flag_lines(_block_commands(tag, rows)):
            try:
                env, argv = _split(text)
            except ValueError as e:  # unbalanced quotes: a shell would refuse it too
                env, argv = {}, [UNPARSABLE, text, str(e)]
            if not argv:
                continue
            if argv[0] == "export":
                page_env.update(_split(shlex.join(argv[1:]))[0])
                continue
            commands.append(Command(rel, number, argv, env, dict(page_env), output))
            if "register" in argv and argv[0].endswith("pyflyte"):
                page_env.update(env)  # read at registration: the secret, the Ray cluster's shape
    return commands


COMMANDS = [c for doc in DOCS for c in doc_commands(doc)]


# ----------------------------------------------------------------------------- the checks


def _pyflyte_run(argv: list[str]) -> tuple[bool, str, str, list[str]]:
    """(remote, file, workflow, the workflow's input words) of `pyflyte [opts] run [opts] FILE WF ...`."""
    rest = argv[argv.index("run") + 1:]
    file_at = next(i for i, w in enumerate(rest) if w.endswith(".py"))
    return "--remote" in rest[:file_at], rest[file_at], rest[file_at + 1], rest[file_at + 2:]


def _inputs(words: list[str]) -> dict[str, str]:
    inputs, words = {}, list(words)
    while words:
        name = words.pop(0)
        assert name.startswith("--"), f"workflow input expected, got {name!r}"
        name, eq, value = name[2:].partition("=")
        inputs[name] = value if eq else words.pop(0)
    return inputs


def _workflow(file: str, name: str):
    assert (ROOT / file).exists(), f"{file} does not exist"
    module = importlib.import_module(file.removesuffix(".py").replace("/", "."))
    assert hasattr(module, name), f"{file} has no workflow {name}"
    return getattr(module, name)


def _cluster(cmd: Command) -> ClusterShape:
    from tasks.cluster import train_cluster

    env = {**cmd.page_env, **cmd.env}
    return train_cluster(int(env.get("MILES_RAY_GPU_WORKERS", "1")), int(env.get("MILES_RAY_GPUS_PER_WORKER", "8")))


def _token(cmd: Command, remote: bool) -> str | None:
    env = {**cmd.page_env, **cmd.env}
    return env.get(TOKEN_ENV) or ("mounted-from-the-secret" if remote and env.get(SECRET_ENV) else None)


def check_workflow_run(cmd: Command, monkeypatch) -> None:
    argv = ["pyflyte", "run", *DEFAULT_WORKFLOW, *cmd.argv[2:]] if cmd.program == "./dev" else cmd.argv
    remote, file, name, words = _pyflyte_run(argv)
    inputs = _inputs(words)
    if cmd.program == "./dev":  # ./dev run names the embedded default's preset first (flags given win)
        inputs["flags"] = f"--preset tiny-reverse4 {inputs.get('flags', '')}".strip()
    unknown = set(inputs) - set(_workflow(file, name).python_interface.inputs)
    assert not unknown, f"{name} has no input(s) {sorted(unknown)}"
    if name == "fully_async_rl":
        _validate_run(cmd, remote, inputs, monkeypatch)


def _validate_run(cmd: Command, remote: bool, inputs: dict[str, str], monkeypatch) -> None:
    import tasks.inputs

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    if token := _token(cmd, remote):
        monkeypatch.setenv(TOKEN_ENV, token)
    monkeypatch.setattr(tasks.inputs, "on_cluster", lambda: remote)  # on a cluster it checks the Ray task's shape
    cfg = tasks.inputs.run_config(inputs.get("flags", ""), inputs.get("run_id", ""), inputs.get("storage_root", ""),
                                  int(inputs.get("segment_steps", 0)), cluster=_cluster(cmd) if remote else None)
    if not remote:  # locally the driver checks the machine's Ray before any actor starts
        validate(cfg, cluster=LOCAL_MACHINE)
    assert setting_warnings(cfg) == [], f"the documented command gives its model settings only a toy wants: {setting_warnings(cfg)}"
    check_against_the_model(cfg)


# The config.json of each pretrained model a documented run names (by the last part of its
# --hf-checkpoint), as the model's own repository has it (the fields the checks read).
MODEL_CONFIGS = {
    "Qwen2.5-1.5B": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 1536,
                     "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 131072,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu"},
    "Qwen2.5-1.5B-Instruct": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 1536,
                              "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                              "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
                              "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                              "hidden_act": "silu"},
    "Llama-2-7b": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                   "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
                   "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"},
}


def check_against_the_model(cfg) -> None:
    """A documented run of a pretrained model fits that model: its own config.json passes the trainer's
    model checks (`model_problems`: TP/EP divide it, recompute fits its layers, --gpu-memory-gb holds
    it), and --max-seq-len / --rollout-max-response-len stay within its context."""
    name = cfg.model.hf_checkpoint.rstrip("/").rsplit("/", 1)[-1]
    hf_config = MODEL_CONFIGS.get(name)
    if hf_config is None:
        return
    assert model_problems(hf_config, cfg) == [], model_problems(hf_config, cfg)
    context = hf_config["max_position_embeddings"]
    for flag, value in (("--max-seq-len", cfg.data.max_seq_len),
                        ("--rollout-max-response-len", cfg.rollout.rollout_max_response_len)):
        assert value is None or value <= context, f"{flag} {value} is beyond {name}'s context ({context})"
    heads = hf_config["num_attention_heads"]
    assert heads % cfg.train.tensor_model_parallel_size == 0, f"{name}'s {heads} heads do not split over TP"


def _miles(argv: list[str]) -> tuple[int, str]:
    """`miles ARGV` in this process: (exit status, what it printed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = miles_main(argv)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
    return status, out.getvalue()


def check_miles_validate(cmd: Command, tmp_path, monkeypatch) -> None:
    _readers_paths(cmd.argv, tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    for name, value in {**cmd.page_env, **cmd.env}.items():
        monkeypatch.setenv(name, value)
    status, printed = _miles(cmd.argv[1:])
    want = 2 if cmd.shows_error() else 0
    assert status == want, f"exit {status}, the doc shows {'an error' if want else 'success'}:\n{printed}"
    if want == 0:
        check_against_the_model(parse_flags(cmd.argv[2:], check=False))
    toy = [line for line in printed.splitlines() if re.match(r"miles validate: warning: --(lr|rollout-max-response-len|"
                                                             r"micro-batch-size) ", line)]
    assert not toy, f"the documented command gives its model settings only a toy wants: {toy}"


def _readers_paths(argv: list[str], tmp_path: Path) -> None:
    """The reader's own local inputs a command names (`./Llama-2-7b`), as empty stand-ins under tmp_path."""
    for word in argv:
        if word.startswith("./") and not (ROOT / word).exists():
            (tmp_path / word).mkdir(parents=True, exist_ok=True)


# Options of the lineage commands (with a value, or none); the rest of their arguments are run flags.
OWN_OPTIONS = {"--at-step": 1, "--new-run": 1, "--steps": 1, "--from-step": 1, "--out": 1, "--json": 0, "-o": 1}


def check_lineage_flags(cmd: Command) -> None:
    words, flags = cmd.argv[3:], []
    while words:
        word = words.pop(0)
        if word in OWN_OPTIONS:
            del words[:OWN_OPTIONS[word]]
        else:
            flags.append(word)
    validate(parse_flags(flags, base=embedded_default()))  # on top of the reader's recorded run


@pytest.fixture(scope="module")
def fixture_run(tmp_path_factory) -> tuple[str, str]:
    """A small finished run root (3 groups committed, 2 consumed at steps 0 and 1, a timeline trace of
    120 steps): (its URI, a group id)."""
    root = tmp_path_factory.mktemp("docs-run")
    cfg = parse_flags(["--preset", "tiny-reverse4", "--storage-root", f"file://{root}", "--run-id", "r"])
    store = Store(cfg.run_uri)
    write_config(store, cfg)
    with DurableBuffer.open(store, capacity_groups=8, unused_handler=DropUnused(), consumed_through_step=-1) as buf:
        for i in range(3):
            buf.put(make_group(i, version=i))
        got = [buf.get().group_id for _ in range(2)]
        buf.record_consumed(0, got[:1])
        buf.record_consumed(1, got[1:])
    write_steps(store, steps=120)  # the docs show --steps 100:110
    write_status(store, FINISHED, last_step=1, segment=0)
    return cfg.run_uri, got[0]


# The read-only commands: where their run URI (or storage root) is among their words.
INSPECT = {("runs", "show"): 2, ("runs", "list"): 2, ("buffer", "inspect"): 2, ("report",): 1, ("lineage",): 1,
           ("engines", "show"): 2, ("trace",): 1, ("doctor",): 1}


def check_inspection(cmd: Command, fixture_run, tmp_path, monkeypatch) -> None:
    uri, group = fixture_run
    args = cmd.argv[1:]
    at = next(n for words, n in INSPECT.items() if tuple(args[:len(words)]) == words)
    args[at] = uri.rsplit("/runs/", 1)[0] if args[:2] == ["runs", "list"] else uri
    if args[0] == "lineage":
        args[at + 1] = group
    monkeypatch.chdir(tmp_path)
    status, printed = _miles(args)
    assert status == 0, f"`miles {' '.join(args)}` on a fixture run: exit {status}\n{printed}"


def check_engines_change(cmd: Command, tmp_path, monkeypatch) -> None:
    """`miles engines add|remove RUN_URI N` on a fresh run root of N + 1 engines: exit 0, the target moved by N."""
    args = cmd.argv[1:]
    count = int(args[3])
    cfg = parse_flags(["--preset", "tiny-reverse4", "--storage-root", f"file://{tmp_path}/store", "--run-id", "r",
                       "--rollout-num-engines", str(count + 1)])
    write_config(Store(cfg.run_uri), cfg)
    args[2] = cfg.run_uri
    monkeypatch.chdir(tmp_path)
    status, printed = _miles(args)
    want = count + 1 + (count if args[1] == "add" else -count)
    assert status == 0 and f": {want}\n" in printed, f"`miles {' '.join(args)}` on a fresh run: exit {status}\n{printed}"


def check_import_model(cmd: Command) -> None:
    source = cmd.argv[2]
    if source.startswith("import:"):
        assert source[len("import:"):] in PACKAGED, f"{source}: no such packaged model ({sorted(PACKAGED)})"


def check_paths(cmd: Command) -> None:
    """`python -m MODULE`, `python FILE`, `bash FILE`, `pyflyte register|package ... DIR`: they exist."""
    args = cmd.argv[1:]
    if cmd.program.startswith("python") and args[:1] == ["-m"]:
        if args[1].split(".")[0] in REPO_PACKAGES:
            assert importlib.util.find_spec(args[1]) is not None, f"no module {args[1]}"
        return
    for path in _named_paths(cmd.program, args):
        assert (ROOT / path).exists(), f"{path} does not exist in the repository"


def _named_paths(program: str, args: list[str]) -> list[str]:
    if program == "pyflyte":  # `--pkgs DIR ... package`, `register ... DIR`
        pkgs = [args[args.index("--pkgs") + 1]] if "--pkgs" in args else []
        return pkgs + (args[-1:] if "register" in args else [])
    return [] if not args or args[0].startswith("-") else args[:1]


def _kind(cmd: Command) -> str | None:
    args = cmd.argv[1:]
    if cmd.argv[0] == UNPARSABLE:
        return "unparsable"
    if cmd.argv[0].startswith("--"):
        return "flags"
    if cmd.program == "./dev":
        return "workflow" if args[:1] == ["run"] else None
    if cmd.program == "pyflyte":
        return "workflow" if "run" in args else "paths"
    if cmd.program in ("python", "python3", "bash"):
        return "paths"
    if cmd.program != "miles" or not args:
        return None
    if args[0] == "validate":
        return "validate"
    if args[0] in ("fork", "replay"):
        return "lineage-flags"
    if args[0] == "import-model":
        return "import-model"
    if args[:1] == ["engines"] and args[1:2] in (["add"], ["remove"]):
        return None if cmd.shows_error() else "engines-change"
    if any(tuple(args[:len(words)]) == words for words in INSPECT):
        return None if cmd.shows_error() else "inspect"
    return None


def _elided(cmd: Command) -> bool:
    """`miles validate ... --tensor-model-parallel-size 1 ...`: a part left out, not a command to run."""
    return "..." in " ".join(cmd.argv).split()


CHECKED = [c for c in COMMANDS if _kind(c) and not _elided(c)]


@pytest.mark.parametrize("cmd", CHECKED, ids=lambda c: c.where)
def test_doc_command(cmd: Command, fixture_run, tmp_path, monkeypatch):
    """Pins: the command at this doc line runs as shown (see the module docstring for what each kind
    must do). Guards: a doc command that fails validation, names a missing file or workflow input, or
    asks for more than the cluster it names."""
    kind = _kind(cmd)
    try:
        if kind == "workflow":
            check_workflow_run(cmd, monkeypatch)
        elif kind == "validate":
            check_miles_validate(cmd, tmp_path, monkeypatch)
        elif kind == "lineage-flags":
            check_lineage_flags(cmd)
        elif kind == "flags":
            validate(parse_flags(cmd.argv, base=embedded_default()))  # the flags of a run, listed by topic
        elif kind == "inspect":
            check_inspection(cmd, fixture_run, tmp_path, monkeypatch)
        elif kind == "engines-change":
            check_engines_change(cmd, tmp_path, monkeypatch)
        elif kind == "import-model":
            check_import_model(cmd)
        elif kind == "unparsable":
            raise AssertionError(f"a shell cannot split this line: {cmd.argv[2]}")
        else:
            check_paths(cmd)
    except (AssertionError, ConfigError) as e:
        pytest.fail(f"{cmd.where}: `{shlex.join(cmd.argv)}`\n{e}")


def test_the_docs_have_commands_of_every_kind():
    """Pins: the extraction finds the docs' commands (so a broken extractor cannot pass by finding none).
    Guards: a fence syntax or prompt style the extractor misses."""
    kinds = [_kind(c) for c in CHECKED]
    for kind, least in {"workflow": 8, "validate": 3, "lineage-flags": 2, "inspect": 3, "paths": 6,
                        "engines-change": 2}.items():
        assert kinds.count(kind) >= least, (kind, kinds.count(kind))
    remote = [c for c in CHECKED if _kind(c) == "workflow" and "--remote" in c.argv]
    assert len(remote) >= 2, [c.where for c in remote]
    # flytekit's default `--copy auto` bundles only the modules registration imported (images/__init__.py)
    assert all(" --copy all " in f" {' '.join(c.argv)} " for c in remote), [c.where for c in remote
                                                                              if "--copy" not in c.argv]


# ----------------------------------------------------------------------------- flyte.config


def _ini_snippet() -> str:
    text = (ROOT / "docs/deployment.md").read_text()
    return re.search(r"## flyte\.config\n.*?```ini\n(.*?)```", text, re.S).group(1)


def test_flyte_config_snippet_reads_as_shown(tmp_path):
    """Pins: the `flyte.config` snippet of docs/deployment.md, copied as is, gives flytekit the endpoint,
    the insecure flag and the S3 endpoint it shows. Guards: an inline `# comment`, which the INI reader
    keeps as part of the value."""
    from flytekit.configuration import DataConfig, PlatformConfig
    from flytekit.configuration.file import ConfigFile

    snippet = _ini_snippet()
    shown = dict(_shown(line) for line in snippet.splitlines() if "=" in line and not line.lstrip().startswith("#"))
    parser = configparser.ConfigParser()
    parser.read_string(snippet)
    values = {k: parser.get(s, k) for s in parser.sections() for k in parser.options(s)}
    assert values == shown, "flytekit reads other values than the snippet shows (an inline # comment?)"
    path = tmp_path / "flyte.config"
    path.write_text(snippet)
    config = ConfigFile(str(path))
    platform, data = PlatformConfig.auto(config), DataConfig.auto(config)
    assert (platform.endpoint, platform.insecure) == (shown["url"], False) and shown["insecure"] == "False"
    assert data.s3.endpoint == shown["endpoint"]


def _shown(line: str) -> tuple[str, str]:
    """A `key = value` line as a reader reads it: the value ends where a `#` comment starts."""
    key, _, value = line.partition("=")
    return key.strip(), value.split("#")[0].strip()


GROUPS = {"runs", "buffer", "engines"}  # commands with subcommands: `miles runs show`, `miles buffer inspect`


def _command_words(cmd: Command) -> tuple[str, ...]:
    args = cmd.argv[1:]
    return tuple(args[:2]) if args[0] in GROUPS and len(args) > 1 else tuple(args[:1])


HELPED = sorted({_command_words(c) for c in COMMANDS if c.program == "miles" and c.argv[1:]})


@pytest.mark.parametrize("words", HELPED, ids=" ".join)
def test_every_miles_command_in_the_docs_answers_help(words):
    """Pins: `miles COMMAND --help` of every command the docs use exits 0 and prints its usage.
    Guards: a documented command the CLI no longer has, or one whose --help is read as an argument."""
    status, printed = _miles([*words, "--help"])
    assert status == 0 and "usage" in printed.lower(), f"`miles {' '.join(words)} --help`: exit {status}\n{printed}"
