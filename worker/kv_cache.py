"""This rank's shard of the paged KV pool, plus its CPU swap tier.

Per layer, K and V caches have shape ``[num_blocks, block_size, Hkv_rank, D]``
(DESIGN's KV layout). Block ids are per tier: device ids index
``key_caches``, CPU ids index ``cpu_key_caches``. A hybrid model's layers share
them (``scheduler.kv_groups``): ``layer_slots[i]`` is the cache local layer ``i``
reads, one layer of each KV cache group per cache, each group through its own
block table, so a block id names one group's block in every cache. The scheduler
decides every move; this class only executes swap-out, swap-in and copy through
the attention backend, in that order, before the forward. A multi-head latent
attention model (DeepSeek, ``shared_kv``) caches one vector a token that serves as
both key and value: its value caches are its key caches, so a block costs half.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import AttentionBackend


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, shared_kv: bool = False) -> int:
    """Bytes of one block (K and V, all layers) on one rank: ``2*L*B*Hkv*D*elem``
    (``L``: the caches, a hybrid model's group size; one, not two, with ``shared_kv``)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return (1 if shared_kv else 2) * num_layers * block_size * num_kv_heads * head_dim * elem


def _pairs(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)


class KVCache:
    """Device KV pool shard and CPU swap shard for every layer of one rank."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend, num_cpu_blocks: int = 0,
                 layer_slots: list[int] | None = None, shared_kv: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.num_blocks, self.num_cpu_blocks = num_blocks, num_cpu_blocks
        self.block_size = block_size
        self.backend = backend
        self.layer_slots = list(range(num_layers)) if layer_slots is None else list(layer_slots)
        if len(self.layer_slots) != num_layers or min(self.layer_slots, default=0) < 0:
            raise ValueError(f"layer_slots must give each of {num_layers} layers a cache, "
                             f"got {layer_slots}")
        num_caches = max(self.layer_slots, default=-1) + 1
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zero-filled, not empty: a kernel that masks unused slots after the
        # matmul must never meet NaN garbage (0 * NaN is NaN).
        self.key_caches = [torch.zeros(shape, dtype=dtype, device=device)
                           for _ in range(num_caches)]
        self.shared_kv = shared_kv
        self.value_caches = self.key_caches if shared_kv else [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_caches)]
        cpu_shape = (num_cpu_blocks, block_size, num_kv_heads, head_dim)
        pin = device.type == "cuda"
        self.cpu_key_caches = [torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin)
                               for _ in range(num_caches)]
        self.cpu_value_caches = self.cpu_key_caches if shared_kv else [
            torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin) for _ in range(num_caches)]

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(key_cache, value_cache)]`` per layer, as the model's forward takes them."""
        return [(self.key_caches[s], self.value_caches[s]) for s in self.layer_slots]

    def _check(self, what: str, ids: torch.Tensor, limit: int) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
            raise IndexError(f"{what} block id out of range [0, {limit}): {ids.tolist()}")

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks; pairs are ``(device_block, cpu_block)``."""
        if not pairs:
            return
        p = _pairs(pairs)
        self._check("swap-out device", p[:, 0], self.num_blocks)
        self._check("swap-out cpu", p[:, 1], self.num_cpu_blocks)
        self.backend.swap_blocks(self.key_caches, self.cpu_key_caches, p)
        if not self.shared_kv:
            self.backend.swap_blocks(self.value_caches, self.cpu_value_caches, p)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy CPU blocks back to device blocks; pairs are ``(device_block, cpu_block)``."""
        if not pairs:
            return
        p = _pairs(pairs).flip(1).contiguous()  # backend wants (src, dst) = (cpu, device)
        self._check("swap-in cpu", p[:, 0], self.num_cpu_blocks)
        self._check("swap-in device", p[:, 1], self.num_blocks)
        self.backend.swap_blocks(self.cpu_key_caches, self.key_caches, p)
        if not self.shared_kv:
            self.backend.swap_blocks(self.cpu_value_caches, self.value_caches, p)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write ``(src, dst)`` device blocks in every cache."""
        if not pairs:
            return
        p = _pairs(pairs)
        self._check("copy", p, self.num_blocks)
        self.backend.copy_blocks(self.key_caches, self.value_caches,
                                 p.to(self.key_caches[0].device))

    # ---- shipping blocks to another replica --------------------------------------------

    def read_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of device blocks, ``[layers, n, block_size, Hkv_rank, D]`` each, on the
        CPU (what another replica's ``write_blocks`` takes)."""
        idx = torch.tensor(block_ids, dtype=torch.int64)
        self._check("read", idx, self.num_blocks)
        idx = idx.to(self.key_caches[0].device)
        k = torch.stack([_bytes(c).index_select(0, idx) for c in self.key_caches])
        dtype = self.key_caches[0].dtype
        if self.shared_kv:  # (the values are the keys: shipped once, an empty stand-in)
            return k.cpu().view(dtype), torch.empty(0, dtype=dtype)
        v = torch.stack([_bytes(c).index_select(0, idx) for c in self.value_caches])
        return k.cpu().view(dtype), v.cpu().view(dtype)

    def write_blocks(self, block_ids: list[int], keys: torch.Tensor,
                     values: torch.Tensor) -> None:
        """Overwrite device blocks with shipped K and V (``read_blocks``'s layout; with
        ``shared_kv`` the values' stand-in is empty and the keys are written once)."""
        idx = torch.tensor(block_ids, dtype=torch.int64)
        self._check("write", idx, self.num_blocks)
        kc = self.key_caches[0]
        want = (len(self.key_caches), len(block_ids), *kc.shape[1:])
        shipped = [("keys", self.key_caches, keys)]
        if not self.shared_kv:
            shipped.append(("values", self.value_caches, values))
        for name, _, t in shipped:
            if tuple(t.shape) != want or t.dtype != kc.dtype:
                raise ValueError(f"shipped {name} are {tuple(t.shape)} {t.dtype}, this pool "
                                 f"takes {want} {kc.dtype}")
        idx = idx.to(kc.device)
        for _, caches, t in shipped:
            src = _bytes(t.to(kc.device))
            for layer, cache in enumerate(caches):
                _bytes(cache).index_copy_(0, idx, src[layer])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The same memory as bytes along the last dim: index ops that fp8 lacks work on it."""
    return t.view(torch.uint8) if t.element_size() == 1 else t
