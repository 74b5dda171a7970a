#!/usr/bin/env bash
# The prepared GPU check (device machine: torch with CUDA, no registry). Runs every gpu-marked test.
# Needs megatron-core 0.16.1 and the project's CPU-side pins importable; when the machine lacks
# them, put their wheels in wheels/ beside this tree (travels with it) and they are installed offline.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ -d wheels ]]; then python -m pip install -q --no-index --find-links wheels megatron-core==0.16.1 || true; fi
nvidia-smi -L
PYTHONPATH=. timeout 900 python -m pytest -p no:cacheprovider -o addopts="" -m gpu -q -x tests/gpu "$@"
