"""Prefix-affinity request routing between engine replicas.

The ingress tokenises every prompt and computes its prefix-cache keys exactly as the
scheduler does (``hash_prompt_blocks`` over full blocks, model id and cache salt mixed
in). ``PrefixAffinityRouter`` runs inside the ingress's deployment handle: it remembers
which replica was sent which block hashes and sends a request to the replica holding its
deepest matching block, so a shared system prompt is prefilled once per replica instead of
once per request. Without a match, or when the holder is busier than the least-loaded
replica by more than ``imbalance_threshold`` ongoing requests, it picks the least-loaded
replica (ties go to the replica that was routed to least recently, which spreads distinct
prompts). Replica capacity stays bounded by Serve's ``max_ongoing_requests``: a full
replica is skipped by Serve's own rejection protocol, and the handle's
``max_queued_requests`` turns a full cluster into ``BackPressureError``.

How a request's chunks come back, and what happens when its replica dies, is
``dispatch``'s. The same router also addresses one replica by id (``ReplicaCall.target_replica``), which
the ingress uses to collect every replica's stats and health; ``known_replicas`` reads the
replica set from the routers living in this process.
"""

from __future__ import annotations

import logging
import random
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from pagedserve.cluster.lora_serving import adapter_affinity_key
from pagedserve.cluster.wire import EngineRequest
from pagedserve.scheduler.block_hash import hash_prompt_blocks, make_extra_keys
from pagedserve.scheduler.long_rope import prompt_keys
from pagedserve.scheduler.lora_request import lora_cache_key
from pagedserve.scheduler.multimodal import ImageInput
from pagedserve.scheduler.sampling_params import SamplingParams

ROUTER_CLASS_PATH = "pagedserve.cluster.router:PrefixAffinityRouter"

logger = logging.getLogger(__name__)


def routed_request(rid: str, ids: list[int], params: SamplingParams, salt: str | None,
                   info: dict[str, Any], stream: bool, lora: tuple[str, str] | None = None,
                   priority: int = 0, images: Sequence[ImageInput] = ()) -> EngineRequest:
    """An engine request carrying what the router places it by: the prompt's block
    hashes as the replicas' prefix caches key them (model, salt, adapter and LongRoPE's
    key past its pre-trained length included),
    led by the adapter's own key (so an adapter's requests gather where it is loaded)."""
    key = lora_cache_key(*lora) if lora is not None else None
    keys = prompt_keys(make_extra_keys(info["model_id"], salt, key), len(ids),
                       info.get("long_rope_from", 0))
    hashes = hash_prompt_blocks(ids, info["block_size"], keys, images=images)
    if lora is not None:  # for the router only: the replicas compute their own
        hashes.insert(0, adapter_affinity_key(*lora))
    return EngineRequest(rid, ids, params, hashes, salt, stream=stream, lora=lora,
                         priority=priority)


_routers: weakref.WeakSet[PrefixAffinityRouter] = weakref.WeakSet()
_routers_lock = threading.Lock()


def known_replicas(deployment_name: str, app_name: str | None = None) -> list[str]:
    """Ids of the running replicas of a deployment, as seen by this process's routers."""
    ids: set[str] = set()
    with _routers_lock:
        routers = list(_routers)
    for r in routers:
        dep = r._deployment_id
        if dep.name == deployment_name and (app_name is None or dep.app_name == app_name):
            ids.update(rid.unique_id for rid in list(r.curr_replicas))
    return sorted(ids)


def affinity_snapshot(deployment_name: str) -> dict[str, int]:
    """Blocks each replica owns in this process's affinity tables (for stats and tests)."""
    out: dict[str, int] = {}
    with _routers_lock:
        routers = list(_routers)
    for r in routers:
        if r._deployment_id.name == deployment_name:
            for rid, n in r._owned.items():
                out[rid] = out.get(rid, 0) + n
    return out


class PrefixAffinityRouter(RequestRouter):
    """Route to the replica that already holds the prompt's prefix, else the least loaded."""

    def initialize_state(self, max_table_blocks: int = 262_144, imbalance_threshold: int = 8,
                         min_match_blocks: int = 1, **_: Any) -> None:
        """Called by Serve with ``request_router_kwargs``.

        ``max_table_blocks`` bounds the affinity table (LRU); ``min_match_blocks`` is the
        shortest shared prefix (in blocks) worth following.
        """
        self._max_blocks = max_table_blocks
        self._imbalance = imbalance_threshold
        self._min_match = min_match_blocks
        self._table: OrderedDict[bytes, str] = OrderedDict()  # block hash -> replica id
        self._owned: dict[str, int] = {}
        self._last_routed: dict[str, int] = {}  # replica id -> routing sequence number
        self._routed = 0
        self.affinity_hits = 0
        self.affinity_misses = 0
        # Serve pickles this class by value, so this module's globals seen here are a copy;
        # register in the real (imported) module, where ``known_replicas`` looks.
        from pagedserve.cluster import router as home

        with home._routers_lock:
            home._routers.add(self)

    # ---- Serve callbacks ---------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Ranks of replicas, best first; Serve takes the least-loaded available in a rank."""
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        arg = _first_arg(pending_request)
        target = getattr(arg, "target_replica", None)
        if target is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        excluded = set(getattr(arg, "exclude_replicas", ()) or ())
        candidates = [r for r in candidate_replicas
                      if r.replica_id.unique_id not in excluded] or list(candidate_replicas)
        if not candidates:
            return []
        qlen = {r.replica_id.unique_id: self._queue_len(r) for r in candidates}
        ranks: list[list[RunningReplica]] = []
        owner = self._deepest_owner(getattr(arg, "block_hashes", None) or [])
        least = min(qlen.values())
        chosen = None
        if owner is not None:
            chosen = next((r for r in candidates if r.replica_id.unique_id == owner), None)
            if chosen is not None and qlen[owner] - least <= self._imbalance:
                ranks.append([chosen])
                self.affinity_hits += 1
            else:
                chosen = None
        if chosen is None:
            self.affinity_misses += 1
        rest = sorted((r for r in candidates if r is not chosen),
                      key=lambda r: (qlen[r.replica_id.unique_id],
                                     self._last_routed.get(r.replica_id.unique_id, -1),
                                     random.random()))
        ranks.extend([r] for r in rest)
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any,
                          result: Any) -> None:
        """Record that the replica now holds (or soon will hold) the prompt's blocks."""
        arg = _first_arg(pending_request)
        if getattr(arg, "target_replica", None) is not None:
            return  # control calls neither move prefixes nor count as load
        rid = replica_id.unique_id
        self._routed += 1
        self._last_routed[rid] = self._routed
        hashes = getattr(arg, "block_hashes", None)
        if not hashes:
            return
        table = self._table
        for h in hashes:
            prev = table.get(h)
            if prev is not None:
                if prev != rid:
                    self._owned[prev] = self._owned.get(prev, 1) - 1
                    self._owned[rid] = self._owned.get(rid, 0) + 1
                table.move_to_end(h)
            else:
                self._owned[rid] = self._owned.get(rid, 0) + 1
            table[h] = rid
        while len(table) > self._max_blocks:
            _, old = table.popitem(last=False)
            self._owned[old] = self._owned.get(old, 1) - 1

    def _fulfill_next_pending_request(self, replica: RunningReplica,
                                      request_metadata: Any = None) -> None:
        """Hand ``replica`` to exactly the request it was chosen for.

        Serve (2.57 to 2.60 at least) matches by ``internal_request_id``, which every call
        made while serving one HTTP request shares (a multi-prompt completion, the health
        fan-out). Two such calls routed at once would swap replicas, and the second would
        never be assigned. The metadata object itself is unique per call, so match on
        identity first. These are Serve's private helpers: Serve 2.60 also cancels the
        task routing the request (``_cancel_routing_task_for_pending_request``), 2.57 has
        no such task and no such method.
        """
        if request_metadata is not None:
            for pr in self._pending_requests_to_fulfill:
                if pr.metadata is request_metadata and not pr.future.done():
                    cancel = getattr(self, "_cancel_routing_task_for_pending_request", None)
                    if cancel is not None:
                        cancel(pr)
                    self._record_queue_wait_time(pr)
                    pr.future.set_result(replica)
                    self._remove_pending_request_from_indices(pr)
                    return
        super()._fulfill_next_pending_request(replica, request_metadata)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._forget_missing()

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget_missing()

    # ---- helpers -----------------------------------------------------------------------

    def _forget_missing(self) -> None:
        """Drop the blocks of replicas that are gone: their caches died with them."""
        live = {rid.unique_id for rid in self.curr_replicas}
        if all(rid in live for rid in (*self._owned, *self._last_routed)):
            return
        self._table = OrderedDict((h, r) for h, r in self._table.items() if r in live)
        self._owned = {r: n for r, n in self._owned.items() if r in live}
        self._last_routed = {r: n for r, n in self._last_routed.items() if r in live}

    def _deepest_owner(self, hashes: list[bytes]) -> str | None:
        """Owner of the longest cached prefix: hashes are chained, so the deepest hit wins."""
        for depth in range(len(hashes) - 1, self._min_match - 2, -1):
            owner = self._table.get(hashes[depth])
            if owner is not None:
                return owner
        return None

    def _queue_len(self, replica: RunningReplica) -> int:
        q = self.replica_queue_len_cache.get(replica.replica_id)
        return 0 if q is None else q


def _first_arg(pending_request: PendingRequest | None) -> Any:
    if pending_request is None or not pending_request.args:
        return None
    return pending_request.args[0]
