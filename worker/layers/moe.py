"""Routed SwiGLU experts (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3), sharded for tensor parallelism.

Every rank holds every expert, each cut along its intermediate dimension (as
vLLM's default MoE tensor parallelism does): gate/up rows and down columns of
the rank's share. A rank's output is then a partial sum exactly like a
row-parallel layer's, so the routed experts and the shared expert (gated
before the sum, which is linear) add up in one all-reduce per layer. The
router is replicated: each rank picks the same experts for every token.
Under expert parallelism (``ParallelContext.expert_parallel``) a rank holds
whole experts instead, a share of them (``layers.expert_placement``): the
routing's expert ids become the rank's own indices, -1 for another rank's
expert, which every kernel below skips, and the same all-reduce adds the
ranks' parts.

The compute groups the step's token rows by expert (one stable sort), runs
two matmuls per expert that received rows and scatters the weighted results
back with ``index_add_`` in ascending expert order, the summation order of
Hugging Face's implementation. Experts no row chose cost nothing, so a decode
batch reads only the experts it routes to. That loop reads the row counts on
the host, which a CUDA graph cannot capture, so it is the fallback: on CPU one
native call runs the layer's experts (``kernels.cpu_moe``), and on CUDA two
Triton kernels run them as a grouped GEMM without a host sync
(``kernels.triton_moe``), so a decode step can be a CUDA graph
(``graph_capturable``).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import cpu_int8, cpu_moe
from pagedserve.worker.layers.activation import silu_and_mul
from pagedserve.worker.layers.expert_placement import (
    expert_map,
    expert_parallel_problem,
    local_experts,
    owners,
)
from pagedserve.worker.layers.linear import (
    LazyTensor,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pagedserve.worker.layers.moe_routing import route
from pagedserve.worker.layers.packed import PACK_BATCH_HINT, padded_rows
from pagedserve.worker.moe_config import MoEConfig
from pagedserve.worker.parallel import ParallelContext

_EXPERT_RE = re.compile(r"^experts\.(\d+)\.(\w+)\.weight$")
# Checkpoint name of each expert matrix -> (0 gate / 1 up / 2 down).
_MIXTRAL = {"w1": 0, "w3": 1, "w2": 2}
_QWEN = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}


def _triton_ready() -> bool:
    from pagedserve.kernels.backend import available_backends

    return "triton" in available_backends("cuda")


def _capturing(x: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured: its padded rows must not count as routed
    pairs, so replayed decode steps count none."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def take_expert_load(model: nn.Module) -> dict[str, int]:
    """Routed pairs since the last call under expert parallelism (rank 0 only, else
    empty): ``expert_parallel_routed_pairs`` over every layer and step, and
    ``expert_parallel_busiest_pairs``, the sum of each layer-step's busiest rank's
    (``expert_placement.balance`` makes them vLLM's balancedness)."""
    layers = getattr(model, "_expert_load_layers", None)
    if layers is None:
        layers = [m for m in model.modules()
                  if isinstance(m, SparseMoE) and m.rank_pairs is not None]
        model._expert_load_layers = layers
    if not layers:
        return {}
    per_layer = torch.stack([m.rank_pairs for m in layers]).tolist()  # one read to the host
    for m in layers:
        m.rank_pairs.zero_()
    routed, busiest = sum(map(sum, per_layer)), sum(map(max, per_layer))
    return {"expert_parallel_routed_pairs": routed, "expert_parallel_busiest_pairs": busiest}


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)


class SparseMoE(nn.Module):
    """A layer's routed experts plus a shared expert (Qwen2-MoE's sigmoid-gated one,
    DeepSeek's plain ``shared_experts``).

    ``checkpoint_prefix`` is the submodule name the checkpoint files the
    experts under (``block_sparse_moe`` for Mixtral, ``mlp`` for Qwen and DeepSeek).
    A subclass whose experts are not plain SwiGLU without biases (GPT-OSS's) sets
    ``plain_swiglu`` False: the native CPU kernels, which bake that in, are then never
    used; the expert loop runs its ``_gate_up`` / ``_activate`` / ``_down``, and it
    passes its extras to the Triton kernels itself (``_routed``).
    """

    plain_swiglu: bool = True
    # Matrices stacked in an expert's first projection: gate and up (SwiGLU); 1 for an
    # ungated expert (Nemotron 3's: ``layers.moe_nemotron``).
    gate_up_parts: int = 2

    def __init__(self, hidden: int, moe: MoEConfig, ctx: ParallelContext, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        w = ctx.world_size
        # Expert parallelism: whole experts, a share of them; else a slice of every one.
        self.expert_parallel = ctx.expert_parallel and w > 1
        if self.expert_parallel:
            if (why := expert_parallel_problem(moe.num_experts, w)) is not None:
                raise ValueError(why)
            self.held = local_experts(moe.num_experts, ctx.rank, w, ctx.expert_placement)
        else:
            if moe.intermediate_size % w:
                raise ValueError(f"expert intermediate size {moe.intermediate_size} is not "
                                 f"divisible by TP size {w} (enable_expert_parallel keeps "
                                 "experts whole)")
            self.held = list(range(moe.num_experts))
        # Global expert id -> this rank's index, -1 elsewhere (None: it holds them all).
        self.expert_map = expert_map(moe.num_experts, self.held, device) \
            if self.expert_parallel else None
        self._local_index = {e: i for i, e in enumerate(self.held)}
        # Rank 0 (which reports the step's counters) sees every rank's routing: routed
        # pairs per rank, summed until ``take_expert_load`` reads them.
        self.rank_owner = self.rank_pairs = None
        if self.expert_parallel and ctx.rank == 0:
            self.rank_owner = torch.tensor(owners(moe.num_experts, w, ctx.expert_placement),
                                           dtype=torch.int64, device=device)
            self.rank_pairs = torch.zeros(w, dtype=torch.int64, device=device)
        self.ctx, self.hidden = ctx, hidden
        self.moe = moe
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.num_local_experts = len(self.held)
        self.renormalize = moe.renormalize
        self.full_i = moe.intermediate_size
        self.local_i = moe.intermediate_size // (1 if self.expert_parallel else w)
        self.checkpoint_prefix = "block_sparse_moe" if moe.mixtral_names else "mlp"
        self._names = _MIXTRAL if moe.mixtral_names else _QWEN
        # After ``pack`` (CPU): the native kernel's packed gate/up and down stacks, or
        # else each expert's two matrices packed for oneDNN.
        self.native: tuple[torch.Tensor, torch.Tensor] | None = None
        # CUDA with Triton: the fused kernels (``kernels.triton_moe``), no host sync.
        self.fused = device.type == "cuda" and _triton_ready()
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # After ``quantize`` (``layers.quant``): each expert's gate/up and down as int8.
        self.int8: list[tuple[cpu_int8.Int8Weight, cpu_int8.Int8Weight]] | None = None
        # ... or, with the native kernel, stacked for it (``cpu_int8.moe_experts``).
        self.int8_native: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
        # Set by ``worker.batch_invariant``: router GEMM rows padded to a multiple of it.
        self.row_multiple = 0
        self.router = _param((moe.num_experts, hidden),
                             torch.float32 if moe.router_fp32 else dtype, device)
        # DeepSeek-V3's learnt bias on the scores that choose experts (not the weights).
        self.score_bias = _param((moe.num_experts,), torch.float32, device) \
            if moe.score_bias else None
        self.w13 = _param((self.num_local_experts, self.gate_up_parts * self.local_i, hidden),
                          dtype, device)
        self.w2 = _param((self.num_local_experts, hidden, self.local_i), dtype, device)
        self.shared_gate_up = self.shared_down = self.shared_gate = None
        if moe.shared_intermediate_size:
            s = moe.shared_intermediate_size
            self.shared_gate_up = MergedColumnParallelLinear(hidden, [s, s], ctx, dtype, device)
            self.shared_down = RowParallelLinear(s, hidden, False, ctx, dtype, device)
            if moe.shared_gated:
                self.shared_gate = _param((1, hidden), dtype, device)
        self._shared_name = "shared_expert" if moe.shared_gated else "shared_experts"

    def gate_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The router's (or the shared expert's gate's) small GEMM, its rows padded to
        ``row_multiple`` (set by ``worker.batch_invariant``) like the projections'."""
        return padded_rows(lambda t: F.linear(t, weight), x, self.row_multiple)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` through the router's top-k experts (and the shared one)."""
        weights, experts = route(self.router_logits(x), self.moe, self.score_bias)
        if self.rank_pairs is not None and not _capturing(x):
            ranks = self.rank_owner[experts.reshape(-1)]
            self.rank_pairs.index_add_(0, ranks, torch.ones_like(ranks))
        if self.expert_map is not None:
            experts = self.expert_map[experts]  # this rank's indices, -1: another rank's
        out = self._routed(x, experts, weights.to(x.dtype))
        shared = self._shared(x)
        if shared is not None:
            out += shared
        return self.ctx.all_reduce(out)

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's down projection as this rank's partial sum (gated by a
        per-row scalar, the same on every rank, where Qwen2-MoE gates it): it joins the
        experts' before the layer's one all-reduce. None without a shared expert."""
        if self.shared_gate_up is None:
            return None
        shared = self.shared_down.matmul(silu_and_mul(self.shared_gate_up(x)))
        if self.shared_gate is not None:
            shared.mul_(torch.sigmoid(self.gate_linear(x, self.shared_gate)))
        return shared

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router's logits ``[T, E]`` for ``x``."""
        return self.gate_linear(x.float() if self.moe.router_fp32 else x, self.router)

    def _routed(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        if self.native is not None:
            return cpu_moe.experts(x, experts, weights, *self.native)
        if self.int8_native is not None:
            return cpu_int8.moe_experts(x, experts, weights, *self.int8_native)
        if self.fused:
            from pagedserve.kernels import triton_moe

            return triton_moe.experts(x, experts, weights, self.w13, self.w2,
                                      partial=self.expert_parallel)
        n = self.num_local_experts
        flat = experts.reshape(-1)
        if self.expert_map is not None:  # another rank's pairs sort last and are not run
            flat = torch.where(flat < 0, n, flat)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=n + 1).tolist()[:n]
        rows = order // self.top_k  # token row of each routed pair, grouped by expert
        scales = weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            sel = rows[start:start + n]
            y = self._expert(e, x.index_select(0, sel))
            y.mul_(scales[start:start + n])
            out.index_add_(0, sel, y)
            start += n
        return out

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``e``'s output for its rows ``x`` (before the routing weight)."""
        return self._down(e, self._activate(e, self._gate_up(e, x)))

    def _gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return cpu_int8.linear(x, self.int8[e][0])
        if self.packed is None:
            return F.linear(x, self.w13[e])
        return torch.ops.mkldnn._linear_pointwise(x, self.packed[e][0], None, "none", [], "")

    def _activate(self, e: int, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def _down(self, e: int, h: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return cpu_int8.linear(h, self.int8[e][1])
        if self.packed is None:
            return F.linear(h, self.w2[e])
        return torch.ops.mkldnn._linear_pointwise(h, self.packed[e][1], None, "none", [], "")

    def pack(self, release_plain: bool = True) -> None:
        """Repack the experts for CPU: for the native kernel (``kernels.cpu_moe``) where it
        takes them (fp32, bf16), else per expert for oneDNN (``layers.packed``), which at
        the few rows an expert gets per decode step runs about twice as fast as
        ``F.linear``. Experts already quantised stay as they are."""
        if self.int8 is not None or self.int8_native is not None:
            return
        if self.plain_swiglu and cpu_moe.available(self.w13.device, self.w13.dtype,
                                                   self.hidden, self.local_i):
            self.native = cpu_moe.pack(self.w13.data, self.w2.data)
        else:
            reorder = torch.ops.mkldnn._reorder_linear_weight
            self.packed = [(reorder(self.w13[e], PACK_BATCH_HINT),
                            reorder(self.w2[e], PACK_BATCH_HINT))
                           for e in range(self.num_local_experts)]
        if release_plain:
            self.w13 = nn.Parameter(self.w13.new_empty((0,)), requires_grad=False)
            self.w2 = nn.Parameter(self.w2.new_empty((0,)), requires_grad=False)

    def quantize(self, name: str) -> int:
        """Each expert's matrices as int8 codes with a scale per 32 inputs
        (``kernels.cpu_int8``; vLLM's ``experts_int8``), the plain stacks dropped; returns
        their bytes. Where the native kernel is there they are stacked for one call per
        layer (``cpu_int8.moe_experts``), else they run through the expert loop, an int8
        matmul pair per expert that received rows (the same arithmetic)."""
        group = cpu_int8.GROUP
        if self.hidden % group or self.local_i % group:
            raise ValueError(f"quantization='int8': {name} experts have {self.hidden} / "
                             f"{self.local_i} inputs per rank, not multiples of {group}")

        def q(w: torch.Tensor) -> cpu_int8.Int8Weight:
            return cpu_int8.make(*cpu_int8.quantize_symmetric(w), 128)

        pairs = [(q(self.w13[e]), q(self.w2[e])) for e in range(self.num_local_experts)]
        self.w13 = nn.Parameter(self.w13.new_empty((0,)), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.new_empty((0,)), requires_grad=False)
        self.native, self.packed, self.fused = None, None, False
        if self.plain_swiglu and all(a.packed and b.packed for a, b in pairs):
            self.int8_native = (cpu_int8.stack_experts([a for a, _ in pairs]),
                                cpu_int8.stack_experts([b for _, b in pairs]))
            return sum(t.numel() * t.element_size() for st in self.int8_native for t in st)
        self.int8 = pairs
        return sum(a.nbytes + b.nbytes for a, b in pairs)

    def layer_names(self) -> set[str]:
        """Checkpoint names under the decoder layer this layer must load."""
        return {f"{self.checkpoint_prefix}.{n}" for n in self.expected_names()}

    def claims(self, rest: str) -> str | None:
        """The name ``load`` takes for ``rest`` (a tensor's name under its decoder layer)
        when it is one of this layer's, else None."""
        prefix = self.checkpoint_prefix + "."
        return rest[len(prefix):] if rest.startswith(prefix) else None

    def expected_names(self) -> set[str]:
        """Checkpoint names under ``checkpoint_prefix`` this layer must load."""
        names = {"gate.weight"}
        for e in range(self.num_experts):
            names |= {f"experts.{e}.{m}.weight" for m in self._names}
        if self.score_bias is not None:
            names.add("gate.e_score_correction_bias")
        if self.shared_gate_up is not None:
            names |= {f"{self._shared_name}.{m}_proj.weight" for m in ("gate", "up", "down")}
        if self.shared_gate is not None:
            names.add("shared_expert_gate.weight")
        return names

    def load(self, name: str, lazy: LazyTensor) -> bool:
        """Copy this rank's share of ``name`` (relative to ``checkpoint_prefix``); False
        when the name is not one of this layer's."""
        if name == "gate.weight":
            _check(name, lazy, (self.num_experts, self.hidden))
            self.router.data.copy_(lazy[:])
            return True
        if name == "gate.e_score_correction_bias" and self.score_bias is not None:
            _check(name, lazy, (self.num_experts,))
            self.score_bias.data.copy_(lazy[:])
            return True
        if name == "shared_expert_gate.weight" and self.shared_gate is not None:
            _check(name, lazy, (1, self.hidden))
            self.shared_gate.data.copy_(lazy[:])
            return True
        if self.shared_gate_up is not None:
            shared = self._shared_name
            if name in (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"):
                self.shared_gate_up.load(0 if "gate_proj" in name else 1, lazy)
                return True
            if name == f"{shared}.down_proj.weight":
                self.shared_down.load(lazy)
                return True
        m = _EXPERT_RE.match(name)
        if m is None or m.group(2) not in self._names or int(m.group(1)) >= self.num_experts:
            return False
        e, which = self._local_index.get(int(m.group(1))), self._names[m.group(2)]
        if e is None:
            return True  # another rank's expert: never read
        rank = 0 if self.expert_parallel else self.ctx.rank
        lo, hi = rank * self.local_i, (rank + 1) * self.local_i
        if which == 2:
            _check(name, lazy, (self.hidden, self.full_i))
            self.w2.data[e].copy_(lazy[:, lo:hi])
        else:
            _check(name, lazy, (self.full_i, self.hidden))
            part = which * self.local_i
            self.w13.data[e, part:part + self.local_i].copy_(lazy[lo:hi])
        return True


def _check(name: str, lazy: LazyTensor, expected: tuple[int, ...]) -> None:
    if tuple(lazy.shape) != expected:
        raise ValueError(f"{name}: checkpoint shape {tuple(lazy.shape)} != expected {expected}")

