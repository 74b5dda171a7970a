"""The bad-input corpus (issue 16 item 3; docs/configuration.md, "Bad input").

One case per bad input a user can give miles: configurations (every numeric flag's range, NaN and
infinities, unknown flags and values, missing local inputs and unknown URI schemes, unloadable
plug-ins), dataset rows and files, corrupt, truncated, empty and unknown-major Arrow objects and
corrupt consumption manifests in a buffer run root, storage keys with `..` or absolute ones copied to
a node, snapshots without their marker, weights or config or with tensors of the wrong shape,
raising, hanging and wrongly-typed reward and custom generate functions, and `miles` CLI commands on
a run root that holds no run.

Each case asserts a clear error naming the problem (the flag, key, file or function); for the CLI
(run in-process through `miles_core.cli.main`) an exit status != 0 and a message that is not a bare
traceback; for storage, that what was committed before is still there and readable. Hanging
functions run under short timeouts, so no case can hang. The whole corpus runs in the default suite
in about 10 s:

    .venv/bin/python -m pytest tests/bad_inputs -q --durations=5
"""
