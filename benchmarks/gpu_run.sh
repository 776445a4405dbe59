#!/usr/bin/env bash
# Everything GPU-side in one go, for a lent single-GPU machine that has torch, transformers and triton
# but no ray, no vllm and no network. Needs a wheelhouse of the few pure-Python deps it lacks, made
# beforehand on a networked machine:
#   for v in 3.10 3.11 3.12 3.13; do pip download -d .gpu_wheels --only-binary=:all: --python-version $v \
#     --platform manylinux2014_x86_64 pydantic pyyaml tqdm pytest pytest-timeout; done
# Then: bash benchmarks/gpu_run.sh OUT_DIR   (~4 min on an H200; writes JSON and logs to OUT_DIR)
set -uo pipefail
OUT=${1:-${OUT:-/tmp/gpu_out}}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import sys, torch, transformers, triton; print(sys.version.split()[0], torch.__version__, transformers.__version__, triton.__version__)"
python -m pip install -q --no-index --find-links .gpu_wheels pydantic pyyaml tqdm pytest pytest-timeout 2>&1 | grep -v WARNING | tail -3
export PYTHONPATH=$PWD RLBENCH_NB_CACHE=/tmp/rlbench_cache
echo "== tests (ops incl. the CUDA Triton path, precision)"
timeout 200 python -m pytest -q -p no:cacheprovider -o addopts="" tests/ops tests/roles/test_precision.py 2>&1 | tail -15 | tee "$OUT/tests.txt"
echo "== log-prob op memory"
timeout 120 python benchmarks/logprob_memory.py --json "$OUT/logprob_memory.json" 2>&1 | tail -8 | tee "$OUT/logprob_memory.txt"
echo "== GRPO smoke, Qwen2-0.5B shape, bf16"
timeout 240 python benchmarks/gpu_smoke.py --json "$OUT/gpu_smoke.json" 2>&1 | grep -v "it/s\]" | tail -14 | tee "$OUT/gpu_smoke.txt"
