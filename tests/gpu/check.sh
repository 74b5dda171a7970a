#!/usr/bin/env bash
# The prepared GPU check: one command on any CUDA machine (one GPU is enough; python3 with CUDA
# torch, transformers, safetensors, pyarrow, pytest; Ray and a package registry are not needed).
#
#   1. preflight (tests/gpu/preflight.py, <= 60 s): prints python, torch + CUDA, the GPU, where
#      megatron-core comes from, every package and project module the check imports; exit 3 naming
#      what is missing;
#   2. bench/gpu_check.py (<= 330 s): a random ~0.48B Llama through the Megatron trainer in bf16 with
#      the distributed optimizer (train), a checkpoint round trip (checkpoint), the memory estimate
#      against torch.cuda.max_memory_allocated (memory), the CPU engine's model on CUDA against the
#      trainer's log-probs (engine), token-budget packing against padded micro-batches (packing),
#      tokens/s against a plain transformers step (baseline); each phase pass / fail / skip;
#   3. the gpu-marked tests that need no Ray, one GPU (<= 75 s), the MoE families in bf16 among them
#      (tests/gpu/test_moe_bf16.py: tiny Qwen3-MoE and GLM-4.5-style models against transformers).
# About 3 minutes in all on an H200 (docs/training.md, "The GPU check"); at most 465 s.
#
# Where megatron-core is not installed on the GPU machine, it travels as a pure-Python copy of the
# dev venv's package (~6 MiB without __pycache__ and its one unused .so, the dataset helper). On a
# machine with the project's environment, once per megatron-core version:
#
#   bash tests/gpu/check.sh --vendor      # copies it to .gpu_vendor/ (git-ignored), prints the sizes
#
# then copy the working tree with .gpu_vendor/ to the GPU machine and run, in its root:
#
#   bash tests/gpu/check.sh
#
# Other modes: --bench-only, --tests-only, --preflight-only, and --cpu-smoke (anywhere, no GPU: the
# preflight without CUDA and the bench's --cpu-smoke, writing to $OUT only; this script's own test,
# tests/integration/test_gpu_check.py). Results: $OUT (or /tmp/gpu_check_out)
# receives preflight.log, gpu_check.log, gpu_check.json (every phase, written after each one),
# results/gpu_check.json (the results file, bench/results_file.py's schema: copy it to
# bench/results/) and pytest.log. Exit status: 3 preflight, else the bench's (1 = a phase failed,
# 124 = out of time), else pytest's.
set -uo pipefail
cd "$(dirname "$0")/../.."
mode="${1:-all}"
case "$mode" in
  all|--vendor|--bench-only|--tests-only|--preflight-only|--cpu-smoke) ;;
  *) echo "usage: $0 [--vendor|--bench-only|--tests-only|--preflight-only|--cpu-smoke]"; exit 2 ;;
esac
PREFLIGHT_S=60 BENCH_S=330 TESTS_S=75
LIMIT_MIB=64

vendor() {  # run here, not on the device: the megatron-core copy and what the run will carry
  local src
  src=$(.venv/bin/python -c "import importlib.util as u; print(u.find_spec('megatron').submodule_search_locations[0])") \
    || exit 1
  rm -rf .gpu_vendor && mkdir -p .gpu_vendor && cp -r "$src" .gpu_vendor/ \
    && find .gpu_vendor -name __pycache__ -prune -exec rm -rf {} + && find .gpu_vendor -name '*.so' -delete
  local tree vendor_kib
  tree=$(git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  vendor_kib=$(du -sk .gpu_vendor | cut -f1)
  echo "carried: working tree $((tree / 1024)) MiB + .gpu_vendor $((vendor_kib / 1024)) MiB" \
       "= $(((tree + vendor_kib) / 1024)) MiB of the ${LIMIT_MIB} MiB limit"
  # the device's python: the copy must at least compile there (pyenv's shim needs the version named)
  export PYENV_VERSION="${PYENV_VERSION:-$(pyenv versions --bare 2>/dev/null | grep '^3\.12' | tail -1)}"
  if python3.12 -c "" 2>/dev/null; then
    python3.12 - <<'EOF' || exit 1
import pathlib, sys
bad = []
for p in pathlib.Path(".gpu_vendor").rglob("*.py"):
    try:
        compile(p.read_bytes(), str(p), "exec")
    except SyntaxError as e:
        bad.append(f"{p}: {e}")
print(f"python {sys.version.split()[0]}: " + ("; ".join(bad) if bad else "every .gpu_vendor file compiles"))
sys.exit(1 if bad else 0)
EOF
  else
    echo "no python3.12 here: the copy's syntax is not checked for the device's python"
  fi
  (( tree + vendor_kib < LIMIT_MIB * 1024 * 3 / 4 )) || { echo "over 3/4 of the carry limit"; exit 1; }
}

if [[ "$mode" == "--vendor" ]]; then vendor; exit $?; fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -d .gpu_vendor ]]; then export PYTHONPATH="$PWD/.gpu_vendor:$PYTHONPATH"; fi
if [[ -d .whl ]]; then  # alternative: wheels downloaded for the device's python (docs/training.md)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
export PYTHONUNBUFFERED=1
out="${OUT:-/tmp/gpu_check_out}"; mkdir -p "$out/results"
t0=$SECONDS

smoke=""; [[ "$mode" == "--cpu-smoke" ]] && smoke=1  # this script's own test, anywhere: CPU, no pytest

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
  timeout $PREFLIGHT_S python3 tests/gpu/preflight.py ${smoke:+--no-cuda}; } 2>&1 | tee "$out/preflight.log"
if [[ ${PIPESTATUS[0]} -ne 0 ]]; then echo "gpu check: preflight failed (see above; $out/preflight.log)"; exit 3; fi
[[ "$mode" == "--preflight-only" ]] && exit 0

brc=0
if [[ "$mode" != "--tests-only" ]]; then
  results=bench/results/gpu_check.json; [[ -n "$smoke" ]] && results="$out/results/gpu_check.json"
  stamp=$(mktemp)  # a results file older than this run (the committed one) is not passed on
  timeout $BENCH_S python3 bench/gpu_check.py ${smoke:+--cpu-smoke} --out "$out" --results "$results" 2>&1 \
    | tee "$out/gpu_check.log"; brc=${PIPESTATUS[0]}
  if [[ -z "$smoke" && "$results" -nt "$stamp" ]]; then cp "$results" "$out/results/gpu_check.json"; fi
  rm -f "$stamp"
  [[ $brc -eq 124 ]] && echo "gpu check: the bench ran past ${BENCH_S}s; $out/gpu_check.json holds the phases that finished"
fi
trc=0
if [[ "$mode" != "--bench-only" && -z "$smoke" ]]; then
  timeout $TESTS_S python3 -m pytest -p no:cacheprovider -o addopts="" -m gpu -q -x tests/gpu 2>&1 \
    | tee "$out/pytest.log"; trc=${PIPESTATUS[0]}
fi
echo "gpu check: bench exit $brc, tests exit $trc, $((SECONDS - t0)) s; results in $out"
[[ $brc -ne 0 ]] && exit $brc
exit $trc
