"""Trainer: Megatron-core model, HF conversion, off-policy losses, checkpoints (docs/fully-async.md).

On a machine without CUDA, the first import of Megatron in a process (a trainer rank's) first quiets
Megatron's Transformer Engine / Apex fallback warnings (`cpu_shim.quiet_fallback_warnings`) and makes
its jit fuser the identity (`cpu_shim.eager_jit_fuser`: no torch compiler stack in every rank).
Importing this package arranges it without importing torch: the driver imports the rank's actor class
(`miles_core.train.worker`) to start the ranks and needs neither torch nor Megatron (3 CPU-seconds a
run on a 2-core machine).
"""

import sys
from importlib.abc import MetaPathFinder


class _BeforeMegatron(MetaPathFinder):
    """A finder that finds nothing: asked for Megatron the first time, it installs the CPU shim's
    import-time parts, then lets the import go on. (It stays in `sys.meta_path`, done: the import
    system is iterating that list when it asks.)"""

    done = False

    def find_spec(self, name, path=None, target=None):
        if not self.done and (name == "megatron" or name.startswith("megatron.")):
            self.done = True
            _install()
        return None


def _install() -> None:
    from miles_core.train.cpu_shim import eager_jit_fuser, quiet_fallback_warnings

    quiet_fallback_warnings()
    eager_jit_fuser()


if "megatron" in sys.modules:
    _install()  # too late for the jit fuser (it says so by returning False), in time for later warnings
elif not any(isinstance(f, _BeforeMegatron) for f in sys.meta_path):
    sys.meta_path.insert(0, _BeforeMegatron())
