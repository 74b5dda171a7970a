"""The exit status of every `miles` command, by one rule, and the one line that explains a user error.

    0  the command did what it was asked (also when the reader of its output went away: `| head`)
    1  a runtime failure: no run or group where one was named, a run root that cannot be forked or
       replayed as asked, a file that cannot be read
    2  a usage or configuration error: a command line that does not fit the command, a bad flag or
       value (ConfigError, from validate, fork and replay alike), missing storage credentials or the
       package a storage scheme needs, storage unreachable within --storage-timeout (an endpoint,
       network or credentials to fix: the line names what to check)

    status, line = explain(exc)     # None for a bug: the caller lets its traceback show

No user error prints a traceback: missing credentials name the variables to set; storage that
stays unreachable names the URI and how long was tried.
"""

from __future__ import annotations

from miles_core.cli.parsing import UsageError
from miles_core.config import ConfigError
from miles_core.storage import CREDENTIALS_HINT, InvalidName, StorageNotConfigured, StorageError, StorageUnavailable

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

# Credential errors of the object-store clients, by class name (their packages need not be installed).
_CREDENTIALS = {
    "NoCredentialsError": CREDENTIALS_HINT["s3"],
    "PartialCredentialsError": "both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
    "CredentialRetrievalError": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (the configured credential source failed)",
    "DefaultCredentialsError": CREDENTIALS_HINT["gs"],
}


def explain(exc: BaseException) -> tuple[int, str] | None:
    """(exit status, one line) for an error the user can act on; None for anything else (a bug)."""
    if isinstance(exc, UsageError):
        return EXIT_USAGE, str(exc)
    missing = _missing_credentials(exc)
    if missing:
        return EXIT_USAGE, f"no credentials for object storage ({missing[0]}): set {missing[1]}."
    if isinstance(exc, (ConfigError, InvalidName, StorageNotConfigured)):
        return EXIT_USAGE, str(exc)
    if isinstance(exc, StorageUnavailable):
        return EXIT_USAGE, f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (StorageError, ValueError, OSError)):  # RunNotFound and LineageError are ValueErrors
        return EXIT_FAILURE, f"{type(exc).__name__}: {exc}"
    return None


def _missing_credentials(exc: BaseException) -> tuple[str, str] | None:
    """(the client's own words, what to set) when a credential error is in exc's chain."""
    for e in _chain(exc):
        for cls in type(e).__mro__:
            if cls.__name__ in _CREDENTIALS:
                return str(e) or cls.__name__, _CREDENTIALS[cls.__name__]
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out
