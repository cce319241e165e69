"""Shipping a prompt's KV cache from one engine to another (prefill/decode split).

A prefill engine runs a prompt (one sampled token, thrown away) and ships the
K/V of its full blocks, named by their prefix-cache hashes; a decode engine
writes them into free blocks of its own pool and names them by the same
hashes. The request that follows on the decode engine is then an ordinary
prefix-cache hit: it computes only the prompt's partial last block and samples
every token itself, so its output is exactly what it would have been without
the transfer (vLLM's disaggregated prefill makes the same choice: the prefill
side's token is discarded).

Nothing here can change an answer, only how much of a prompt is recomputed: a
block that does not fit, a payload that does not arrive or a layout that does
not match leaves the decode engine computing that part itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve.scheduler.kv_import import ImportReservation
from pagedserve.scheduler.lora_request import LoRARequest
from pagedserve.scheduler.multimodal import ImageInput

if TYPE_CHECKING:
    from pagedserve.cluster.engine import LLMEngine


@dataclass(frozen=True)
class KVLayout:
    """What two engines must share for one's blocks to mean the same in the other."""

    model_id: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_layers: int
    pipeline_layer_partition: tuple[int, ...]
    block_size: int
    num_kv_heads_per_rank: int
    head_dim: int
    kv_cache_dtype: str
    # A hybrid KV cache's groups (``scheduler.kv_groups``; empty: one table): a block
    # then holds one layer of each slot, and the hashes are salted by group.
    kv_group_windows: tuple[int | None, ...] = ()

    @classmethod
    def of(cls, engine: LLMEngine) -> KVLayout:
        info = engine.model_info
        return cls(engine.model_id, int(info["tensor_parallel_size"]),
                   int(info.get("pipeline_parallel_size", 1)), int(info["num_layers"]),
                   tuple(info.get("pipeline_layer_partition") or (int(info["num_layers"]),)),
                   engine.scheduler.block_size,
                   int(info["num_kv_heads_per_rank"]), int(info["head_dim"]),
                   str(info["kv_cache_dtype"]), tuple(info.get("kv_group_windows") or ()))

    def check_compatible(self, shipped: KVLayout) -> None:
        """``ValueError`` naming the first field where ``shipped`` differs from this one."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(shipped, f.name)
            if mine != theirs:
                raise ValueError(f"shipped KV has {f.name}={theirs!r}, this engine "
                                 f"{mine!r}: the two engines must run the same settings")


@dataclass
class KVPayload:
    """The K/V of a prompt's leading full blocks, per rank.

    ``shards[r]`` is rank ``r``'s ``(keys, values)`` (ranks stage by stage, then by
    tensor-parallel rank; the rank holding a draft model adds the draft's keys and
    values, every draft layer, which a decode engine with the same draft writes too),
    each
    ``[stage caches, len(block_hashes), block_size, kv_heads_per_rank, head_dim]`` on the
    CPU: a cache per layer, or with KV cache groups one per slot, whose block holds
    one layer of the group the block belongs to (``block_hashes`` then lists every
    group's blocks under its salted hashes).
    """

    layout: KVLayout
    block_hashes: list[bytes]
    shards: list[tuple[torch.Tensor, ...]]

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.layout.block_size

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for shard in self.shards for t in shard)


def export_prompt_kv(engine: LLMEngine, token_ids: list[int], cache_salt: str | None = None,
                     lora_request: LoRARequest | None = None,
                     images: Sequence[ImageInput] = ()) -> KVPayload:
    """The K/V of the longest leading run of ``token_ids``'s full blocks cached in
    ``engine`` right now (call it between steps, before the blocks can be reused).
    Blocks over an image are named by its content too, so the decode engine's request
    with the same picture hits them and one with another picture does not."""
    hashes = engine.prompt_block_hashes(token_ids, cache_salt, lora_request, images)
    ids, names = engine.scheduler.kv.shippable_prefix(hashes, len(token_ids))
    shards = engine.executor.read_kv_blocks(ids) if ids else []
    engine.stats["kv_exported_blocks"] += len(ids)
    return KVPayload(KVLayout.of(engine), names, shards)


def begin_import(engine: LLMEngine, payload: KVPayload) -> ImportReservation:
    """Check the layout and take blocks for what ``engine`` lacks (scheduler thread)."""
    KVLayout.of(engine).check_compatible(payload.layout)
    ranks = payload.layout.tensor_parallel_size * payload.layout.pipeline_parallel_size
    if len(payload.shards) != (ranks if payload.num_blocks else 0):
        raise ValueError(f"shipped KV has {len(payload.shards)} rank shards for "
                         f"{payload.num_blocks} blocks")
    return engine.scheduler.kv.reserve_import(payload.block_hashes)


def reserved_shards(payload: KVPayload, res: ImportReservation
                    ) -> list[tuple[torch.Tensor, ...]]:
    """Each rank's K/V (and a draft model's) of just the blocks ``res`` took, in its
    order."""
    if res.indices == list(range(payload.num_blocks)):
        return payload.shards
    idx = torch.tensor(res.indices, dtype=torch.int64)
    return [tuple(_pick(t, idx) for t in shard) for shard in payload.shards]


def _pick(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    if t.element_size() == 1:  # fp8 has no index_select on the CPU; its bytes do
        return t.view(torch.uint8).index_select(1, idx).view(t.dtype)
    return t.index_select(1, idx)


def keep_evicted(engine: LLMEngine, res: ImportReservation) -> None:
    """Copy the prefixes the reservation evicted to the CPU tier and name them there
    (KV offloading; nothing to do otherwise). Run it between two steps and before
    the shipped KV is written: the copy reads the blocks that write overwrites."""
    plan = res.offload_plan()
    if plan is None:
        return
    copied = False
    try:
        engine.executor.execute_model(plan)
        copied = True
    finally:
        engine.scheduler.kv.commit_offloads(res, copied)


def end_import(engine: LLMEngine, res: ImportReservation, written: bool) -> int:
    """Name the written blocks and release the reservation; returns blocks named."""
    named = engine.scheduler.kv.commit_import(res, written)
    if written:
        engine.stats["kv_imported_blocks"] += named
    else:
        engine.stats["kv_import_failures"] += 1
    return named


def import_prompt_kv(engine: LLMEngine, payload: KVPayload) -> int:
    """Write a shipped payload into ``engine``'s pool as prefix-cache blocks, at once
    (offline use; ``AsyncEngine.import_kv`` writes off the event loop). Returns how
    many blocks a request with this prompt will now hit that it would have missed."""
    res = begin_import(engine, payload)
    written = False
    try:
        keep_evicted(engine, res)
        if res.blocks:
            engine.executor.write_kv_blocks(res.block_ids, reserved_shards(payload, res))
        written = True
    finally:
        named = end_import(engine, res, written)
    return named

