"""pip's configuration of this machine as `uv pip install` arguments (`./dev setup` installs with uv).

`./dev` passes `pip config list`'s output (`scope.name='value'` lines: pip.conf files and PIP_* variables);
this prints uv's arguments one per line, or exits 1 naming a setting uv would not be given, and `./dev`
then installs with pip. `--index-strategy unsafe-best-match` keeps pip's choice, the best version over
every index (uv's default takes the first index that has a package: a CUDA torch from PyPI over the
machine's local CPU wheel).

    python images/pip_to_uv.py "$(pip config list)"
"""

from __future__ import annotations

import ast
import sys

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}
# what needs no argument: the certificate and the timeout are passed as SSL_CERT_FILE / UV_HTTP_TIMEOUT
IGNORED = {"cert", "default-timeout", "timeout", "disable-pip-version-check", "no-cache-dir", "quiet", "verbose",
           "progress-bar", "root-user-action", "no-input"}


class UnsupportedSetting(ValueError):
    pass


def uv_args(config: str) -> list[str]:
    out = ["--index-strategy", "unsafe-best-match"]
    for line in filter(None, (raw.strip() for raw in config.splitlines())):
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in FLAGS:
            out += [x for v in ast.literal_eval(value).split() for x in (FLAGS[name], v)]
        elif name not in IGNORED:
            raise UnsupportedSetting(f"./dev: pip setting {key} is not given to uv; installing with pip")
    return out


if __name__ == "__main__":
    try:
        print("\n".join(uv_args(sys.argv[1] if len(sys.argv) > 1 else "")))
    except UnsupportedSetting as e:
        sys.exit(str(e))
