"""Compile every Triton kernel for real NVIDIA targets, without a GPU.

The CPU test suite runs the kernels in the interpreter, which accepts code the
GPU compiler rejects (non power-of-two blocks, small tl.dot shapes, type
changes in loop-carried values...). Triton can lower a kernel all the way to a
cubin with its bundled ptxas without a device, so this script does that for
the configurations TritonBackend launches. Run in a subprocess: TRITON_INTERPRET
must be unset when the kernels are decorated.

    python tests/kernels/_aot_compile.py [capability ...] [--only base|sweep]
                                                         # default: 90 80, both parts

The fused MoE kernels print "ok moe sm_..", the int4 GEMM "ok w4 sm_..", the
gated delta rule's decode step "ok gdn sm_..", Mamba-1's update and scan "ok mamba1
sm_..". Narrow KV caches (kv_cache_dtype)
compile as their own variants: fp8 caches
reach the kernels as uint8 bytes (KV_FP8 picks the in-kernel decoding), and a
cache dtype other than the query's changes which dots the kernel emits. Those
lines read "ok kv sm_..", apart from the "ok sm_.." count of default launches.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler import compile as triton_compile

from pagedserve.kernels.triton_attention import (
    _combine_kernel,
    _paged_attention_kernel,
    next_pow2,
)
from pagedserve.kernels.triton_backend import LAUNCH_SWEEP, TritonBackend
from pagedserve.kernels.triton_cache import _copy_blocks_kernel, _store_kv_kernel
from pagedserve.kernels.triton_deltanet import _delta_rule_decode_kernel, block_v
from pagedserve.kernels.triton_mamba1 import BLOCK_D as M1_BLOCK_D
from pagedserve.kernels.triton_mamba1 import _mamba1_scan_kernel, _mamba1_update_kernel
from pagedserve.kernels.triton_moe import BLOCK_M, _down_kernel, _gate_up_kernel
from pagedserve.kernels.triton_w4a16 import BLOCK_N as W4_BLOCK_N
from pagedserve.kernels.triton_w4a16 import _w4a16_kernel


def signature(fn, pointers: dict[str, str], consts: dict, floats: tuple[str, ...] = ()) -> dict:
    """Triton signature: given pointer types, constexprs, fp32 scalars, i32 otherwise."""
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if name in floats else "i32"
    return sig


# Shared memory one block may use on sm_90 (227 KB) and sm_80 (163 KB).
SMEM_LIMIT = {90: 232448, 80: 166912}


def build(fn, pointers, consts, target, floats=(), num_warps=4, num_stages=None,
          tag: str = "ok") -> None:
    src = ASTSource(fn, signature(fn, pointers, consts, floats), consts)
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    kernel = triton_compile(src, target=target, options=options)
    shared = kernel.metadata.shared
    if shared > SMEM_LIMIT.get(target.arch, shared):
        raise SystemExit(f"{fn.__name__} {consts} {options}: {shared} B of shared memory "
                         f"exceeds sm_{target.arch}'s {SMEM_LIMIT[target.arch]}")
    print(f"{tag} sm_{target.arch} {fn.__name__} {consts} {options} shared={shared}", flush=True)


def attention_configs():
    """(dtype, G, D, max_q, splits) the backend can launch, decode and prefill."""
    for dt in ("fp16", "bf16", "fp32"):
        yield dt, 3, 64, 1, 1
        yield dt, 4, 128, 64, 4
    yield "fp16", 8, 128, 1, 16


# Cache element types as the kernel sees them: fp8 as uint8 plus the KV_FP8 flag.
KV_TYPES = {"e4m3": ("u8", 1), "e5m2": ("u8", 2)}


def narrow_cache_configs():
    """(model dtype, cache dtype, G, D, max_q, splits) for kv_cache_dtype, decode and prefill."""
    for dt, kv in (("fp16", "e4m3"), ("bf16", "e5m2"), ("fp32", "e4m3"), ("fp32", "bf16"),
                   ("fp16", "bf16")):
        yield dt, kv, 3, 64, 1, 1
        yield dt, kv, 4, 128, 64, 4
    yield "bf16", "e4m3", 8, 128, 1, 16


def build_attention(target, dt: str, g: int, d: int, max_q: int, splits: int,
                    block_n: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, kv: str | None = None,
                    softcap: bool = False, sinks: bool = False) -> None:
    """One attention launch configuration, with the backend's defaults where not given.

    ``kv`` is the cache dtype (default: the model's ``dt``), as TritonBackend._launch
    picks DOT_F32 and KV_FP8 for it.
    """
    kv = kv or dt
    kv_ptr, kv_fp8 = KV_TYPES.get(kv, (kv, 0))
    block_m = TritonBackend._block_m(g, max_q)
    consts = dict(
        G=g, HEAD_DIM=d, BLOCK_D=next_pow2(d), BLOCK_M=block_m, BLOCK_Q=block_m // g,
        BLOCK_N=block_n or (64 if d <= 64 else 32), NUM_SPLITS=splits,
        DOT_F32=dt == "fp32" or (not kv_fp8 and kv != dt), KV_FP8=kv_fp8, SOFTCAP=softcap,
        SINKS=sinks,
    )
    ptrs = {n: f"*{dt}" for n in ("q_ptr", "out_ptr")}
    ptrs |= {n: f"*{kv_ptr}" for n in ("k_cache_ptr", "v_cache_ptr")}
    ptrs |= {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "sinks_ptr": "*fp32"}
    ptrs |= {n: "*i32" for n in ("block_table_ptr", "cu_q_ptr", "seq_lens_k_ptr",
                                 "tile_seq_ptr", "tile_qoff_ptr")}
    build(_paged_attention_kernel, ptrs, consts, target, ("scale_log2", "softcap_inv", "cap_log2"),
          num_warps=num_warps or (4 if block_m <= 64 else 8), num_stages=num_stages,
          tag="ok" if kv == dt else "ok kv")


def sweep(target) -> None:
    """What bench/kernels.py --sweep launches on an H100/H200 (decode), and its widest
    tiles over an fp8 cache (most registers)."""
    for dt, g, d in (("fp16", 3, 64), ("bf16", 4, 128)):
        for block_n, warps, stages in LAUNCH_SWEEP:
            build_attention(target, dt, g, d, 1, 1, block_n, warps, stages)
        # The default decode launch for a grid short of DECODE_FULL_WAVES waves:
        # K split in 4 with two stages (64 sequences x 3 KV heads on 132 SMs).
        build_attention(target, dt, g, d, 1, 4, num_stages=2)
    for block_n, warps, stages in LAUNCH_SWEEP:
        if block_n == 128:
            build_attention(target, "bf16", 4, 128, 1, 1, block_n, warps, stages, kv="e4m3")


def main(archs: list[int], parts: tuple[str, ...] = ("base", "sweep")) -> None:
    """Compile ``parts`` for each of ``archs``: "base", every target's launches, and
    "sweep", sm_90's launch-setting sweep."""
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        if arch == 90 and "sweep" in parts:
            sweep(target)
        if "base" not in parts:
            continue
        for dt, g, d, max_q, splits in attention_configs():
            build_attention(target, dt, g, d, max_q, splits)
        for max_q, splits in ((1, 1), (1, 4), (64, 1)):  # Gemma 2's softcapped scores
            build_attention(target, "bf16", 2, 256, max_q, splits, softcap=True)
        for max_q, splits in ((1, 4), (64, 1)):  # GPT-OSS's attention sinks
            build_attention(target, "bf16", 8, 64, max_q, splits, sinks=True)
        combine_ptrs = {"out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
                        "sinks_ptr": "*fp32"}
        for sinks in (False, True):
            build(_combine_kernel, combine_ptrs,
                  dict(HEAD_DIM=80, BLOCK_D=128, NUM_SPLITS=3, SPLITS_P2=4, SINKS=sinks), target)
        build(_store_kv_kernel, {"key_ptr": "*fp32", "value_ptr": "*fp32",
                                 "key_cache_ptr": "*bf16", "value_cache_ptr": "*bf16",
                                 "slot_ptr": "*i64"}, dict(ROW=192, BLOCK=256), target)
        build(_copy_blocks_kernel, {"cache_ptr": "*fp16", "pairs_ptr": "*i64"},
              dict(CHUNK=4096), target)
        for dt, kv, g, d, max_q, splits in narrow_cache_configs():
            build_attention(target, dt, g, d, max_q, splits, kv=kv)
        u8 = {n: "*u8" for n in ("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr")}
        build(_store_kv_kernel, u8 | {"slot_ptr": "*i64"}, dict(ROW=192, BLOCK=256), target,
              tag="ok kv")
        build(_copy_blocks_kernel, {"cache_ptr": "*u8", "pairs_ptr": "*i64"},
              dict(CHUNK=4096), target, tag="ok kv")
        for dt in ("fp16", "bf16", "fp32"):  # the fused MoE's two kernels, default tiles
            consts = dict(BLOCK_M=BLOCK_M, BLOCK_N=64, BLOCK_K=32, DOT_F32=dt == "fp32",
                          BIAS=False)
            ids = {"pairs_ptr": "*i64", "experts_ptr": "*i64"}
            build(_gate_up_kernel, {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "h_ptr": f"*{dt}"}
                  | ids, consts | dict(CLAMP=False, RELU2=False), target, tag="ok moe")
            build(_down_kernel, {"h_ptr": f"*{dt}", "w_ptr": f"*{dt}", "y_ptr": "*fp32",
                                 "scale_ptr": "*fp32"} | ids, consts, target, tag="ok moe")
        # GPT-OSS's experts (bf16): biases and the clamped SwiGLU.
        consts = dict(BLOCK_M=BLOCK_M, BLOCK_N=64, BLOCK_K=32, DOT_F32=False, BIAS=True)
        bf = {n: "*bf16" for n in ("x_ptr", "w_ptr", "h_ptr", "b_ptr")} | ids
        build(_gate_up_kernel, bf, consts | dict(CLAMP=True, RELU2=False), target,
              ("alpha", "limit"), tag="ok moe")
        build(_down_kernel, bf | {"y_ptr": "*fp32", "scale_ptr": "*fp32"}, consts, target,
              tag="ok moe")
        # Nemotron 3's ungated squared-ReLU experts (bf16).
        build(_gate_up_kernel, bf, consts | dict(BIAS=False, CLAMP=False, RELU2=True), target,
              tag="ok moe")
        for dt in ("fp16", "bf16", "fp32"):  # int4 weights (W4A16): decode and batch tiles
            for bm in (16, 64):
                ptrs = {"x_ptr": f"*{dt}", "q_ptr": "*i32", "s_ptr": f"*{dt}",
                        "o_ptr": f"*{dt}", "b_ptr": f"*{dt}", "y_ptr": f"*{dt}"}
                build(_w4a16_kernel, ptrs, dict(HAS_BIAS=bm == 64, BLOCK_M=bm,
                                                BLOCK_N=W4_BLOCK_N, DOT_F32=dt == "fp32"),
                      target, tag="ok w4")
        gdn = {n: "*fp32" for n in ("state_ptr", "decay_ptr", "beta_ptr", "q_ptr", "k_ptr",
                                    "v_ptr", "out_ptr")} | {"slots_ptr": "*i64"}
        for dk, dv in ((128, 128), (256, 64)):  # the gated delta rule's decode step
            build(_delta_rule_decode_kernel, gdn, dict(HEADS=32, DK=dk, DV=dv, BLOCK_K=dk,
                                                       BLOCK_V=block_v(dk, dv)),
                  target, tag="ok gdn")
        m1 = {n: "*fp32" for n in ("ssm_ptr", "h_ptr", "x_ptr", "dt_ptr", "a_ptr", "b_ptr",
                                   "c_ptr", "y_ptr")} | {"slots_ptr": "*i64"}
        m1_consts = dict(D=8192, N=16, BLOCK_D=M1_BLOCK_D, BLOCK_N=16)  # (Jamba 1.5 Mini)
        build(_mamba1_update_kernel, m1, m1_consts, target, tag="ok mamba1")
        build(_mamba1_scan_kernel, m1, m1_consts, target, tag="ok mamba1")


if __name__ == "__main__":
    args = sys.argv[1:]
    only = ()
    if "--only" in args:  # one part ("base" or "sweep"), so parts compile side by side
        i = args.index("--only")
        only, args = (args[i + 1],), args[:i] + args[i + 2:]
    main([int(a) for a in args] or [90, 80], only or ("base", "sweep"))
