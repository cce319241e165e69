#!/usr/bin/env bash
# One-shot GPU window: compiled Triton + flash-attn tests, then the kernel benchmark.
# Usage: bash bench/gpu_check.sh [--quick]   (writes bench/results/kernels_gpu.json)
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
mkdir -p bench/results
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 420 python -m pytest -m gpu tests/kernels -q -x -p no:cacheprovider; tests_rc=$?
timeout 300 python bench/kernels.py "${@:---quick}" --json bench/results/kernels_gpu.json; bench_rc=$?
echo "gpu tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))
