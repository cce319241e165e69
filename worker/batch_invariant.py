"""Batch-invariant execution (``batch_invariant=True``): a request's logits, bit for
bit, do not depend on which other requests share its steps, how its prompt was
chunked, or whether a position was computed in a prefill or a decode step.

Why: without it, the same seeded request can sample different tokens alone and
under load (a draw within rounding of a CDF boundary flips), greedy logprobs differ
in their last bits from run to run, and a request resumed on another replica after
a failover (``cluster.resume``) may leave its uninterrupted path. With it, outputs
are a function of the request alone: reproducible evaluations and RL rollouts,
exact failover, debuggable serving. (vLLM's ``VLLM_BATCH_INVARIANT`` offers this on
Hopper and Blackwell GPUs; this mode covers the CPU path.)

Where a row's result depended on the batch here, and what this mode changes:

- GEMMs. oneDNN and MKL choose kernels by the number of rows: one row is a GEMV,
  two, three or five rows take other small-M paths, and these round differently
  from the blocked GEMM. Every projection (and the LM head) pads its rows to a
  multiple of ``ROW_MULTIPLE`` (at least that many), which on the CPUs measured
  gives each row the bits it gets in any other padded call (fp32 and bf16, plain
  and prepacked weights, 1 and 2 threads; ``tests/worker/test_batch_invariant.py``
  checks it on the machine it runs on). ``enable`` tries each kind of projection at
  load and, on a CPU whose BLAS takes a small-M path past 8 rows, the larger
  multiples in ``ROW_MULTIPLES``; a CPU where none suffices is refused, not left
  silently varying.
- Attention. Decode rows and short prefills ran the native per-row kernel, long
  prefills SDPA over the chunk, which sums in another order. Here every query row
  runs the native kernel (``CpuNativeBackend.rows_max_keys``): a row with key length
  L does the same arithmetic whether it is a decode token, a prefill position, a
  resumed token or a speculative draft, and whichever run of a prefill's rows it
  shares K/V tiles with (``enable`` checks that too at load, on this CPU's build).
  Decode steps do not split off shared prefixes (``kernels.cpu_cascade``: the
  merged softmax is the same sum in another order).
- Norms, rotary embedding, the activation, the embedding lookup, sampling and
  logprobs are computed per row already, and so are int8 / int4 projections on the
  native int8 kernel (activations quantised per row and group of 32, exact integer
  dot products, each row's groups summed in one order) and LoRA deltas on the native
  LoRA kernel (each row's delta summed in one order, whatever adapters share the step).
- Mixtures of experts. The native expert kernels (``kernels/cpu_moe.c``, and
  ``moe_int8`` for int8 experts) sum each row alone, in one order, and a token's
  experts in ascending expert order, however many rows route to an expert; the
  router's and the shared expert's gate GEMMs are padded like the projections
  (``SparseMoE.row_multiple``). Experts off the native kernels (the torch loop runs
  one GEMM per expert over the rows routed to it) are refused.

Cost: a decode step of fewer than ``ROW_MULTIPLE`` sequences computes that many
rows, and prefills past ``cpu_backend.ROWS_MAX_KEYS`` keys run on the native rows
kernel where the default mode switches to SDPA (``bench/batch_invariance.py``
measures both against the default mode).

Refused with a ``ValueError`` naming ``batch_invariant``: CUDA (the GEMM and
attention kernels there pick split strategies by batch shape; not done), the torch
attention backend, MoE experts, int4/int8 weights or LoRA adapters without their
native kernels, and models the native kernel cannot run (fp16 queries, head sizes
that are not multiples of 16).

Tensor parallelism: two ranks' partial sums add in one order; over more ranks the
all-reduces gather every rank's partials and add them in rank order
(``ParallelContext.fixed_order``) instead of a ring whose order moves with the
tensor's size.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from pagedserve.kernels import cpu_int8, cpu_lora, cpu_native
from pagedserve.kernels.backend import AttentionBackend
from pagedserve.kernels.cpu_backend import CpuNativeBackend
from pagedserve.kernels.testing import make_paged_batch
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.layers.moe import SparseMoE
from pagedserve.worker.layers.packed import PackableLinear
from pagedserve.worker.parallel import ParallelContext

logger = logging.getLogger(__name__)

# Rows per GEMM call are padded to a multiple of this. Below 4 rows, and for the
# fifth row of a 5-row call, MKL and oneDNN round differently from larger calls here.
ROW_MULTIPLE = 8
# Multiples tried at load, in order: the first that gives every row the same bits is
# kept (a larger one costs a decode step of few sequences more padded rows).
ROW_MULTIPLES = (ROW_MULTIPLE, 16, 32)


def unsupported_reason(device: torch.device, backend: AttentionBackend,
                       model_config: ModelConfig, dtype: torch.dtype,
                       kv_dtype: torch.dtype, quantization: str | None,
                       lora: bool) -> str | None:
    """Why batch-invariant mode cannot run this worker's set-up (None: it can)."""
    if device.type != "cpu":
        return (f"runs on CPU only; on {device.type} the GEMM and attention kernels "
                "pick their split by batch shape")
    if not isinstance(backend, CpuNativeBackend):
        return (f"needs the 'cpu' attention backend (the native per-row kernels), "
                f"not {getattr(backend, 'name', type(backend).__name__)!r}")
    if quantization and not cpu_int8.native_available():
        return (f"does not cover {quantization} weights without the native int8 kernel "
                "(its torch fallback is not checked for batch invariance)")
    if lora and not cpu_lora.available(device, dtype):
        return ("does not cover LoRA adapters without the native LoRA kernel (its torch "
                "fallback is not checked for batch invariance)")
    reason = cpu_native.unsupported_reason(dtype, kv_dtype, model_config.num_heads,
                                           model_config.num_kv_heads, model_config.head_dim)
    if reason is not None:
        return f"the native attention kernel does not take {reason}"
    return None


def enable(model: nn.Module, backend: AttentionBackend, model_config: ModelConfig,
           device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
           quantization: str | None = None, lora: bool = False,
           ctx: ParallelContext | None = None) -> None:
    """Switch ``model`` (built, quantised and packed) and its attention backend to
    batch-invariant execution, or raise ``ValueError`` saying why it cannot be."""
    reason = unsupported_reason(device, backend, model_config, dtype, kv_dtype,
                                quantization, lora)
    if reason is None and any(isinstance(m, SparseMoE) and m.native is None
                              and m.int8_native is None for m in model.modules()):
        reason = ("does not cover MoE experts off the native expert kernels (the torch "
                  "loop's GEMM per expert takes however many rows route to it)")
    if reason is not None:
        raise ValueError(f"batch_invariant {reason}")
    choose_row_multiple(model, model_config.hidden_size, dtype)
    if varying_attention(model_config, dtype, kv_dtype):
        raise ValueError(
            "batch_invariant: on this CPU the native attention kernel gives a prefill row "
            "other bits in a run of rows than alone")
    assert isinstance(backend, CpuNativeBackend)
    backend.rows_max_keys = math.inf
    backend.shared_prefix_min_tokens = 0  # a split softmax sums in another order
    if ctx is not None:
        ctx.fixed_order = True


def varying_attention(model_config: ModelConfig, dtype: torch.dtype,
                      kv_dtype: torch.dtype) -> bool:
    """Whether the native kernel's runs of prefill rows (one code path) give a row
    other bits than the row alone (the decode path, another): the two are written to
    do the same arithmetic in the same order, which the compiler could still break
    on another CPU or compiler, so it is tried at load (~ms) with this model's heads,
    with and without a sliding window (whose rows each start at their own key)."""
    hq, hkv, d = model_config.num_heads, model_config.num_kv_heads, model_config.head_dim
    q_len, k_len = 37, 70  # a run cut mid-tile, cached context before it
    b = make_paged_batch([q_len], [k_len], hq, hkv, d, 16, dtype=dtype, kv_dtype=kv_dtype)
    tables = b.block_table.expand(q_len, -1).contiguous()
    lens = torch.arange(k_len - q_len + 1, k_len + 1, dtype=torch.int32)

    def rows(chunks: torch.Tensor | None, window: int | None) -> torch.Tensor:
        return cpu_native.paged_decode(b.q, b.key_cache, b.value_cache, tables, lens, k_len,
                                       d ** -0.5, chunks=chunks, window=window)

    for window in (None, 29):  # 29: windows starting mid-tile, shorter than the run's keys
        alone = rows(None, window)
        if any(not torch.equal(rows(cpu_native.row_chunks([q_len], n), window), alone)
               for n in (2, 5, cpu_native.ROWS_PER_CHUNK)):
            return True
    return False


def choose_row_multiple(model: nn.Module, hidden: int, dtype: torch.dtype) -> int:
    """Set every projection's ``row_multiple`` to the first of ``ROW_MULTIPLES`` under
    which no GEMM varies (``varying_gemm``) and return it; ``ValueError`` naming the
    GEMM when none does."""
    bad = None
    for multiple in ROW_MULTIPLES:
        for module in model.modules():
            if isinstance(module, PackableLinear | SparseMoE):
                module.row_multiple = multiple
        bad = varying_gemm(model, hidden, dtype)
        if bad is None:
            if multiple != ROW_MULTIPLE:
                logger.info("batch_invariant: GEMM rows padded to a multiple of %d on "
                            "this CPU", multiple)
            return multiple
    raise ValueError(
        f"batch_invariant: on this CPU the {bad} GEMM gives a row other bits in calls of "
        f"other sizes even with rows padded to a multiple of {ROW_MULTIPLES[-1]}")


def _gemms(model: nn.Module, hidden: int
           ) -> Iterator[tuple[str, int, int, Callable[[torch.Tensor], torch.Tensor]]]:
    """(name, input width, row multiple, row-wise GEMM) of one module of each kind and
    input width: the projections, and each MoE layer's router and shared-expert gate."""
    seen: set[tuple[str, int]] = set()
    for module in model.modules():
        if isinstance(module, PackableLinear):
            width = getattr(module, "lora_in_features", hidden)
            found = [(type(module).__name__, width, module.matmul)]
        elif isinstance(module, SparseMoE):
            found = [(f"{type(module).__name__} {name}", hidden,
                      lambda t, m=module, w=w: m.gate_linear(t, w))
                     for name, w in (("router", module.router),
                                     ("shared expert gate", module.shared_gate))
                     if w is not None]
        else:
            continue
        for name, width, fn in found:
            if (name, width) not in seen:
                seen.add((name, width))
                yield name, width, module.row_multiple, fn


def varying_gemm(model: nn.Module, hidden: int, dtype: torch.dtype) -> str | None:
    """The first kind of GEMM whose padded matmul still gives a row different bits
    alone and among 2, 3 or 5 rows or across padded sizes (m + 1 and 2m + 3 rows, m
    its ``row_multiple``) (None: none). One module of each kind and input width is
    tried, at load, so that a CPU whose BLAS needs more padding than the multiple
    gives is caught instead of silently varying (~110 ms for SmolLM2 at m = 8)."""
    gen = torch.Generator().manual_seed(0)
    for name, width, multiple, fn in _gemms(model, hidden):
        m = max(multiple, 1)
        sizes = (2, 3, 5, m + 1, 2 * m + 3)
        x = torch.randn(sizes[-1], width, generator=gen).to(dtype)
        with torch.no_grad():
            alone = torch.cat([fn(x[i:i + 1]) for i in range(sizes[-1])])
            if any(not torch.equal(fn(x[:n]), alone[:n]) for n in sizes):
                return name
    return None
