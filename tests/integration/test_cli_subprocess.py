"""The `miles` command as a user's shell runs it (a subprocess): no traceback for a user's mistake.

Pins: a reader that closes the pipe early (`miles validate --help | head`) ends the command quietly
with exit 0; `miles runs show s3://...` without credentials is one line naming what to set (exit 2);
a read-only command against storage that does not answer gives up after --storage-timeout (one
line, exit 1) instead of the storage layer's 60 s; `python -m miles_core.cli` is the same command.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.seaweed import free_port
from tests.support.timeouts import COMMAND_SECONDS

CLI_SECONDS = 180  # one `miles` command in a fresh interpreter, storage calls included

MILES = Path(sys.executable).with_name("miles")
NO_AWS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE")


def _env(**extra: str) -> dict[str, str]:
    """This environment without AWS credentials, pointing S3 at a local port where nothing listens."""
    env = {k: v for k, v in os.environ.items() if k not in NO_AWS}
    env.update(AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent",
               AWS_EC2_METADATA_DISABLED="true", MILES_S3_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}",
               PYTHONWARNINGS="ignore", **extra)
    return env


def _miles(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(MILES), *args], capture_output=True, text=True, timeout=CLI_SECONDS, env=env)


@pytest.mark.parametrize("args", [["validate", "--help"], ["--version"]], ids=["long output", "short output"])
def test_a_closed_pipe_ends_the_command_quietly(args):
    """Guards: `miles validate --help | head` ending in a BrokenPipeError traceback (a long output breaks
    at a write, a short one at the flush when Python exits)."""
    proc = subprocess.Popen([sys.executable, "-m", "miles_core.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env())
    proc.stdout.close()  # the reader is gone before the first line is written (the import takes longer)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=COMMAND_SECONDS) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_no_credentials_is_one_line_naming_what_to_set():
    """Guards: the 77-line botocore NoCredentialsError traceback."""
    proc = _miles("runs", "show", "s3://bucket/run", env=_env())
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("miles runs: no credentials") and "AWS_ACCESS_KEY_ID" in proc.stderr


def test_unreachable_storage_gives_up_after_the_storage_timeout():
    """Guards: read-only commands retrying for 60 s against storage that does not answer."""
    env = _env(AWS_ACCESS_KEY_ID="AKIAFAKEACCESSKEY123", AWS_SECRET_ACCESS_KEY="fake-secret-never-printed")
    started = time.monotonic()
    proc = _miles("buffer", "inspect", "--storage-timeout", "2", "s3://bucket/run", env=env)
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr  # an endpoint, network or credentials to fix (issue 36)
    assert proc.stderr.count("\n") == 1, proc.stderr  # one line: no retry warnings before it
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("miles buffer: StorageUnavailable: storage at s3://bucket/run unreachable"), proc.stderr
    assert "--storage-timeout=2 s" in last and "Traceback" not in proc.stderr
    assert "fake-secret-never-printed" not in proc.stderr
    assert elapsed < 40, elapsed  # start-up included; the storage layer alone would retry for 60 s


def test_gs_without_credentials_is_one_line_within_the_storage_timeout(tmp_path):
    """Guards (issue 36): gs:// without credentials printing a 60-line gcsfs traceback with S3 hints after
    34 s against --storage-timeout 5 (google-auth probing a metadata server, gcsfs retrying)."""
    env = _env(HOME=str(tmp_path), CLOUDSDK_CONFIG=str(tmp_path / "gcloud"))
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    started = time.monotonic()
    proc = _miles("runs", "show", "gs://bucket/run", "--storage-timeout", "5", env=env)
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "GOOGLE_APPLICATION_CREDENTIALS" in proc.stderr and "AWS" not in proc.stderr
    assert elapsed < 30, elapsed  # start-up included
