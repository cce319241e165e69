#!/usr/bin/env bash
# One-shot GPU window: every `gpu` test (compiled Triton and flash-attn kernels against the
# oracle; the engine's Hugging Face parity, CUDA-graph decode, gpu_memory_utilization
# profiling and swap preemption), then the kernel benchmark.
#
# Usage: bash bench/gpu_check.sh [--quick]   (writes bench/results/kernels_gpu.json, and a
# copy of it and of the test log under $OUT when that is set)
#
# The GPU box has torch, triton, transformers and pytest but no package index and none of
# pagedserve's serving dependencies (Ray, FastAPI, gguf): the package is put on the path
# from this checkout, and only test files that import none of those run.
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
if ! "$PY" -c "import pagedserve.kernels" 2>/dev/null; then
    site=$(mktemp -d)
    mkdir -p "$site/pagedserve"
    for d in scheduler kernels worker cluster; do ln -s "$PWD/$d" "$site/pagedserve/$d"; done
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
out=${OUT:-bench/results}
mkdir -p bench/results "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', t.__version__)"
timeout 400 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --durations=8 \
    tests/kernels/test_kern_gpu.py tests/worker/test_cuda_graph_runner.py \
    tests/cluster/test_engine_gpu.py 2>&1 | tee "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 200 "$PY" bench/kernels.py "${@:---quick}" --json bench/results/kernels_gpu.json
bench_rc=$?
[ "$out" != bench/results ] && cp bench/results/kernels_gpu.json "$out/" 2>/dev/null
echo "gpu tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))
