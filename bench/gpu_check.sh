#!/usr/bin/env bash
# One-shot GPU window: every `gpu` test (compiled Triton and flash-attn kernels against the
# oracle; the engine's Hugging Face parity, CUDA-graph decode, gpu_memory_utilization
# profiling and swap preemption), then the kernel benchmark, then offline throughput
# against Hugging Face generate / generate_batch on a random SmolLM2-135M-shaped model,
# then the int4 W4A16 GEMM against cuBLAS bf16 at Llama-8B's projection shapes, then
# (last, least needed) the Triton decode launch-setting sweep at 2048- and 8192-key
# contexts (keys per step, warps, pipeline stages, forced K splits).
#
# Usage: bash bench/gpu_check.sh [--quick]   (the kernel benchmark's flag; default --quick)
# Writes bench/results/{kernels_gpu,offline_gpu,w4a16_gpu,sweep_gpu}.json, and copies them
# and the five steps' logs to $OUT when that is set (nine files).
# The five steps' time limits add up to 580 s, under the device tool's 600 s for one
# command; each step's output survives a later one's timeout (the sweep prints each
# setting as it is timed), and one hung test is cut at 150 s.
#
# The GPU box has torch, triton, transformers and pytest but no package index and none of
# pagedserve's serving dependencies (Ray, FastAPI, pydantic, gguf): the package is put on
# the path from this checkout, and only test files that import none of those run
# (tests/test_gpu_check_imports.py keeps them so).
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
timeout 300 "$PY" -m pytest -m gpu -q -rfEs -p no:cacheprovider --durations=8 --timeout=150 \
    tests/kernels/test_kern_gpu.py tests/worker/test_cuda_graph_runner.py \
    tests/cluster/test_engine_gpu.py tests/kernels/test_kern_gpu_kv_dtype.py \
    tests/cluster/test_moe.py tests/kernels/test_kern_triton_moe.py tests/worker/test_prequant.py \
    tests/cluster/test_gpt_oss.py tests/kernels/test_kern_sinks.py \
    tests/kernels/test_kern_triton_w4a16.py tests/cluster/test_int4_gpu.py \
    tests/cluster/test_models_gpu.py tests/cluster/test_gemma3_images.py \
    tests/cluster/test_gemma3_pan_and_scan.py \
    tests/cluster/test_llava_next_images.py tests/cluster/test_encoders.py \
    tests/cluster/test_modernbert.py tests/cluster/test_granite_hybrid.py \
    tests/kernels/test_kern_triton_deltanet.py tests/cluster/test_hybrid_spec_decode.py \
    tests/cluster/test_qwen3_next_mtp.py tests/kernels/test_kern_triton_mamba1.py 2>&1 \
    | tee "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 100 "$PY" bench/kernels.py "${@:---quick}" --json bench/results/kernels_gpu.json \
    2>&1 | tee "$out/kernels_gpu.log"
bench_rc=${PIPESTATUS[0]}
timeout 90 "$PY" bench/offline.py --random-weights --num-prompts 128 --output-len 64 \
    --json bench/results/offline_gpu.json 2>&1 | tee "$out/offline_gpu.log"
offline_rc=${PIPESTATUS[0]}
timeout 30 "$PY" bench/w4a16.py --reps 20 --json bench/results/w4a16_gpu.json \
    2>&1 | tee "$out/w4a16_gpu.log"
timeout 60 "$PY" bench/kernels.py --sweep --json bench/results/sweep_gpu.json \
    2>&1 | tee "$out/sweep_gpu.log"
sweep_rc=${PIPESTATUS[0]}
if [ "$out" != bench/results ]; then
    cp bench/results/kernels_gpu.json bench/results/offline_gpu.json \
        bench/results/w4a16_gpu.json bench/results/sweep_gpu.json "$out/" 2>/dev/null
fi
echo "gpu tests rc=$tests_rc kernel bench rc=$bench_rc offline bench rc=$offline_rc" \
    "sweep rc=$sweep_rc (124: cut short, see the log)"
exit $(( tests_rc != 0 || bench_rc != 0 || offline_rc != 0 ))
