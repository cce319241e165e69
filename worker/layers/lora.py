"""Multi-LoRA in one batch: each row of a step may run with a different adapter.

Every attention and MLP projection carries a :class:`LoRAWeights`: per loaded
adapter, one ``A [R, in]`` and one ``B [out, R]`` for the whole fused matmul
(q/k/v, gate/up). A fused module's pieces stack their A's, and B is block
diagonal, so ``(x @ A.T) @ B.T`` adds each piece's delta to its own output
columns only (a piece the adapter does not target has no rows at all). The
LoRA scale is folded into B at load.

A step's rows come ordered by adapter (the runner sorts its requests), so
each adapter owns one contiguous run of rows (:class:`LoRABatch`). On CPU in
fp32 or bf16 one native call per projection adds every run's delta
(``kernels/cpu_lora``: Punica's segmented SGMV, each adapter's pieces kept
apart so B's zero blocks cost nothing); elsewhere each run's delta is two
thin matmuls on a view of that run, added in place. Either way the cost is
the adapters' rank, never ``max_loras`` times it.

Tensor parallel: column-parallel modules hold their rank's rows of B (A
whole); row-parallel ones their rank's columns of A (B whole). The partial
deltas of a row-parallel module are added before its all-reduce, which sums
them exactly as it sums the base matmul's partial products.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.kernels import cpu_lora
from pagedserve.worker.loaders.lora import LoRAAdapter, load_lora_adapter

# Adapter module -> (attribute path of the fused projection, piece of it).
_TARGETS: dict[str, tuple[str, str, str | int | None]] = {
    "q_proj": ("self_attn", "qkv_proj", "q"),
    "k_proj": ("self_attn", "qkv_proj", "k"),
    "v_proj": ("self_attn", "qkv_proj", "v"),
    "o_proj": ("self_attn", "o_proj", None),
    "gate_proj": ("mlp", "gate_up_proj", 0),
    "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", None),
    # Qwen3-Next's attention gate: the gate rows of its files' ``q_proj`` (the model's
    # ``split_lora`` moves them here), never an adapter's own module name.
    "attn_gate_proj": ("self_attn", "gate_proj", None),
}


def _target(model: torch.nn.Module, layer_idx: int, name: str) -> torch.nn.Module | None:
    """The projection module adapter target ``name`` of layer ``layer_idx`` lands on; None
    where the layer has no such projection (a mixture-of-experts layer's MLP, a hybrid's
    recurrent layer, which has no attention)."""
    parent, attr, _ = _TARGETS[name]
    owner = getattr(model.layers[layer_idx], parent, None)
    if name == "up_proj" and not hasattr(owner, attr):  # (an ungated MLP: Nemotron-H's)
        attr = "up_proj"
    return getattr(owner, attr, None)


@dataclass
class LoRABatch:
    """This step's runs of rows per adapter: ``(lora_id, start, end)``, and for the
    native kernel the same runs as int64 ``(start, end, slot)`` rows."""

    groups: list[tuple[int, int, int]] = field(default_factory=list)
    segments: torch.Tensor | None = None
    slots: dict[int, int] = field(default_factory=dict)  # lora_id -> slot


class LoRAWeights:
    """One projection's adapters: ``lora_id -> (A [R, in_local], B [out_local, R])``
    (the torch form), or, on the native path, their pieces in ``native``."""

    def __init__(self, batch: LoRABatch, native: cpu_lora.NativeLoRATable | None = None
                 ) -> None:
        self.batch = batch
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.native = native

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """Add every adapted row's ``x @ A.T @ B.T`` to ``y`` in place."""
        batch = self.batch
        native = self.native
        if native is not None and native.entries and batch.segments is not None \
                and not native.apply(y, x, batch.segments):
            self._apply_pieces(y, x)  # (tensors the kernel does not take: same math)
        if not self.adapters:  # every adapter here is in the native table
            return
        for lora_id, start, end in batch.groups:
            ab = self.adapters.get(lora_id)
            if ab is None:
                continue
            a, b = ab
            if start == 0 and end == y.shape[0]:
                y.addmm_(x @ a.t(), b.t())
            else:
                y[start:end].addmm_(x[start:end] @ a.t(), b.t())

    def _apply_pieces(self, y: torch.Tensor, x: torch.Tensor) -> None:
        assert self.native is not None
        for lora_id, start, end in self.batch.groups:
            for a_t, b_t, col in self.native.entries.get(self.batch.slots[lora_id], ()):
                delta = x[start:end].float() @ a_t @ b_t  # fp32 weights, as the kernel
                y[start:end, col:col + b_t.shape[1]] += delta.to(y.dtype)


def _fuse(pieces: list[tuple[torch.Tensor, torch.Tensor, int]], out_size: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the pieces' A's; place each (scaled) B at its output offset, block diagonal."""
    a = torch.cat([p[0] for p in pieces])
    b = a.new_zeros(out_size, a.shape[0])
    col = 0
    for pa, pb, off in pieces:
        b[off:off + pb.shape[0], col:col + pa.shape[0]] = pb
        col += pa.shape[0]
    return a, b


class LoRAManager:
    """Attaches :class:`LoRAWeights` to a Llama-family model and loads adapters into it."""

    def __init__(self, model: torch.nn.Module, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model, self.max_lora_rank = model, max_lora_rank
        self.dtype, self.device = dtype, device
        self.batch = LoRABatch()
        self.paths: dict[int, str] = {}
        self.native = cpu_lora.available(device, dtype)
        for module in self._modules():
            if module.lora is None:
                table = cpu_lora.NativeLoRATable(
                    module.lora_pieces, module.lora_in_features,
                    module.weight_out_features) if self.native else None
                module.lora = LoRAWeights(self.batch, table)

    def add(self, lora_id: int, path: str) -> None:
        """Load an adapter for this rank; loading the same id and path again is a no-op."""
        if lora_id in self.paths:
            if self.paths[lora_id] != path:
                raise ValueError(f"lora_int_id {lora_id} is already loaded from "
                                 f"{self.paths[lora_id]!r}")
            return
        adapter = load_lora_adapter_for(self.model, path, self.max_lora_rank)
        fused: dict[int, tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor, int]]]]
        fused = {}
        fold = getattr(self.model, "lora_multiplier", None)
        for (layer_idx, name), (a, b, scale) in adapter.weights.items():
            module = _target(self.model, layer_idx, name)
            if fold is not None:  # (multipliers folded into the weights fold in here too)
                scale *= fold(f"{_TARGETS[name][0]}.{name}")
            pa, pb, off = module.lora_piece(_TARGETS[name][2], a, b * scale)
            fused.setdefault(id(module), (module, []))[1].append((pa, pb, off))
        slots = self.batch.slots
        slot = min(set(range(len(slots) + 1)) - set(slots.values()))
        for module, pieces in fused.values():
            table = module.lora.native
            if table is not None and all(table.fits(pb.shape[0], off) for _, pb, off in pieces):
                table.set(slot, [(*cpu_lora.pad_rank(pa.t().float(), pb.t().float()), off)
                                 for pa, pb, off in pieces])
                continue
            a, b = _fuse(pieces, module.weight_out_features)
            module.lora.adapters[lora_id] = (a.to(self.device, self.dtype).contiguous(),
                                             b.to(self.device, self.dtype).contiguous())
        slots[lora_id] = slot
        self.paths[lora_id] = path

    def adapter_bytes(self) -> int:
        """Device bytes of one adapter of rank ``max_lora_rank`` on every projection of
        this rank: what each loaded adapter may take, reserved when CUDA sizes the pool."""
        elements = 0
        for module in self._modules():
            rank = module.lora_pieces * self.max_lora_rank
            elements += rank * (module.lora_in_features + module.weight_out_features)
        return elements * torch.empty((), dtype=self.dtype).element_size()

    def _modules(self) -> list[torch.nn.Module]:
        """Every projection that carries adapters (the fused ones once)."""
        out: dict[int, torch.nn.Module] = {}
        for i in range(len(self.model.layers)):
            for name in _TARGETS:
                module = _target(self.model, i, name)
                if module is not None:
                    out[id(module)] = module
        return list(out.values())

    def remove(self, lora_id: int) -> bool:
        """Drop an adapter's weights from every projection; False if it was not loaded."""
        if self.paths.pop(lora_id, None) is None:
            return False
        slot = self.batch.slots.pop(lora_id)
        for module in self._modules():
            module.lora.adapters.pop(lora_id, None)
            if module.lora.native is not None:
                module.lora.native.clear(slot)
        return True

    def set_batch(self, lora_ids: list[int], q_lens: list[int]) -> None:
        """This step's runs of token rows per adapter (``lora_ids[i]`` for ``q_lens[i]``
        rows, in order); requests sorted by adapter make one run each."""
        missing = set(lora_ids) - set(self.paths) - {0}
        if missing:
            raise ValueError(f"LoRA adapters {sorted(missing)} are not loaded on this rank")
        groups: list[tuple[int, int, int]] = []
        row = 0
        for lora_id, n in zip(lora_ids, q_lens, strict=True):
            if lora_id and groups and groups[-1][0] == lora_id and groups[-1][2] == row:
                groups[-1] = (lora_id, groups[-1][1], row + n)
            elif lora_id:
                groups.append((lora_id, row, row + n))
            row += n
        self.batch.groups = groups
        if self.native:
            slots = self.batch.slots
            self.batch.segments = torch.tensor(
                [(start, end, slots[lora_id]) for lora_id, start, end in groups],
                dtype=torch.int64).reshape(-1, 3)

    def clear_batch(self) -> None:
        self.batch.groups = []
        self.batch.segments = None


def load_lora_adapter_for(model: torch.nn.Module, path: str, max_lora_rank: int
                          ) -> LoRAAdapter:
    """The adapter's full weights, checked against the model's projection shapes."""
    cfg = getattr(model, "config", None)
    fused = None
    if cfg is not None and cfg.model_type == "phi3":  # its projections are fused in files
        q, kv, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
            cfg.intermediate_size
        fused = {"qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
                 "gate_up_proj": [("gate_proj", i), ("up_proj", i)]}
    rename = getattr(model, "lora_name", None) or getattr(model, "checkpoint_name", None)
    # (a hybrid's own module names, as its weights load or as its adapters name them)
    adapter = load_lora_adapter(path, len(model.layers), max_lora_rank, fused, rename)
    split = getattr(model, "split_lora", None)  # (Qwen3-Next's q_proj: query and gate)
    if split is not None:
        adapter.weights = split(adapter.weights)
    for (layer_idx, name), (a, b, _) in adapter.weights.items():
        module = _target(model, layer_idx, name)
        if module is None:
            raise ValueError(f"{path}: layer {layer_idx} {name}: the layer has no such "
                             "projection (its MLP is a mixture of experts, or it is a "
                             "recurrent layer); adapters on experts and recurrent mixers "
                             "are not supported")
        want_in, want_out = module.lora_full_shape(_TARGETS[name][2])
        if a.shape[1] != want_in or b.shape[0] != want_out:
            raise ValueError(
                f"{path}: layer {layer_idx} {name}: lora_A {tuple(a.shape)} / lora_B "
                f"{tuple(b.shape)} do not fit the model's {want_out} x {want_in} projection")
    return adapter
