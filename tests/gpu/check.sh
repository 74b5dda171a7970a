#!/usr/bin/env bash
# The prepared GPU check, one command on the device machine (one H200, torch with CUDA, no package
# registry). Runs bench/gpu_check.py (Megatron trainer, bf16 DDP + Megatron optimizer, GRPO steps
# of a random ~0.48B Llama, checkpoint save/restore with equal next-step losses, tokens/s against a
# plain transformers step), then the gpu-marked tests that need no Ray (the one-GPU case).
#
# What the device lacks is megatron-core (it has torch, transformers, safetensors, pyarrow, numpy,
# fsspec, cloudpickle, pytest). megatron-core 0.16.1 is pure Python apart from an unused dataset
# helper, so a copy of the dev venv's package travels with the tree (about 6 MiB). Here, once:
#
#   mkdir -p .gpu_vendor && cp -r .venv/lib/python3.11/site-packages/megatron .gpu_vendor/ \
#     && find .gpu_vendor -name __pycache__ -prune -exec rm -rf {} + \
#     && find .gpu_vendor -name '*.so' -delete
#
# (.gpu_vendor/ is git-ignored), then on the device (the `run` tool):
#
#   run(command="bash tests/gpu/check.sh", carry=[".gpu_vendor"], timeout_s=600)
#
# Options: --bench-only (skip the tests), --tests-only. $OUT, when set, receives gpu_check.json, the
# bench results file (gpu_check.results.json, docs/benchmarks.md) and
# the logs. Exit status: the bench's (1 = checkpoint resume mismatch), else pytest's.
set -uo pipefail
cd "$(dirname "$0")/../.."
mode="${1:-all}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -d .gpu_vendor ]]; then export PYTHONPATH="$PWD/.gpu_vendor:$PYTHONPATH"; fi
if [[ -d .whl ]]; then  # alternative: wheels downloaded for the device's python (see docs/training.md)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
export PYTHONUNBUFFERED=1
out="${OUT:-/tmp/gpu_check_out}"; mkdir -p "$out"
nvidia-smi -L || true
python3 -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
  || { echo "megatron-core is not importable: carry .gpu_vendor (see the header of $0)"; exit 3; }
rc=0
if [[ "$mode" != "--tests-only" ]]; then
  timeout 480 python3 bench/gpu_check.py --out "$out" --results "$out/gpu_check.results.json" 2>&1 | tee "$out/gpu_check.log"; rc=${PIPESTATUS[0]}
fi
if [[ "$mode" != "--bench-only" ]]; then
  timeout 300 python3 -m pytest -p no:cacheprovider -o addopts="" -m gpu -q -x tests/gpu 2>&1 | tee "$out/pytest.log"
  prc=${PIPESTATUS[0]}; [[ $rc -eq 0 ]] && rc=$prc
fi
exit $rc
