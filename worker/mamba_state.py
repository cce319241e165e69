"""Each sequence's recurrent state in a hybrid model's Mamba-2 (or gated DeltaNet)
layers, on one rank.

Attention layers page their KV through the scheduler's block tables; a Mamba layer
instead folds everything a sequence has seen into a fixed-size state: its causal
convolution's last ``d_conv - 1`` inputs and an SSM state ``[heads, head_dim,
d_state]`` (fp32: it is summed into at every token, and rounding it to 16 bits
every step would drift). A gated DeltaNet layer (Qwen3-Next) keeps the same two
parts, its "SSM" tensor the ``[value heads, key dim, value dim]`` fast-weight
matrix of the delta rule. Each sequence holds one slot of per-layer tensors here
from its first step until the plan names it finished or aborted.

The slots are this rank's own bookkeeping, not the scheduler's: every rank of an
engine sees the same plans in the same order, so each assigns the same slots, and
nothing on the wire changes. What the scheduler does still maps onto them:

- a step that starts a sequence at token 0 (a new request, or one preempted by
  recompute and now run again) zeroes its slot;
- swap preemption moves only KV blocks: the state stays in its slot meanwhile;
- a row that samples for siblings (``n > 1``) hands each its own copy of the
  state at the prompt's end (``fork``), as the scheduler forks their blocks;
- a sequence that resumes past token 0 from a prefix-cache hit starts from the
  snapshot the plan names (``restore_state``): with prefix caching on
  (``scheduler.state_cache``) this rank keeps copies of states at block
  boundaries where the plan says (``save_state``, after the forward) and frees
  them when it says (``dropped_states``, just before those saves); one resuming
  without a snapshot (KV shipped from another replica) cannot be served, and
  meeting one here is an error, not a silent zero state.

Slots grow by doubling when every one is taken: live sequences (running, swapped,
or preempted and waiting) bound them. ``max_num_seqs`` slots are made up front and
come out of the KV budget (``kv_budget.num_device_blocks``; a CUDA profile counts
them in its peak), so a full batch never grows them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from pagedserve.scheduler.outputs import ScheduledRequest


@dataclass
class MambaStep:
    """One step's rows, as every Mamba layer of the forward reads them.

    ``single`` rows compute one token each (decodes, one-token prompts): they run
    batched, their slots in ``single_slots`` and flat rows in ``single_rows`` (None:
    every row of the step is single, in order). ``multi`` lists the rest as ``(first
    flat row, tokens, slot)``: each runs the chunked scan on its own.
    """

    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]
    single_slots: torch.Tensor
    single_rows: torch.Tensor | None
    multi: list[tuple[int, int, int]]


class MambaStates:
    """Slots of per-layer conv and SSM state, one slot per live sequence."""

    def __init__(self, conv_shape: tuple[int, int], ssm_shape: tuple[int, int, int],
                 num_layers: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 8, snapshots: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if snapshots < 0:
            raise ValueError(f"snapshots must be >= 0, got {snapshots}")
        self.conv_shape, self.ssm_shape = conv_shape, ssm_shape
        self.dtype, self.device = dtype, device
        self.conv = [torch.zeros((capacity, *conv_shape), dtype=dtype, device=device)
                     for _ in range(num_layers)]
        self.ssm = [torch.zeros((capacity, *ssm_shape), dtype=torch.float32, device=device)
                    for _ in range(num_layers)]
        self.slot_of: dict[str, int] = {}
        self.free = list(range(capacity - 1, -1, -1))  # (pop() takes the lowest)
        # Prefix caching (``scheduler.state_cache``): copies of states at block
        # boundaries, named by the block's hash; the scheduler's directory bounds them.
        self.snap_conv = [torch.zeros((snapshots, *conv_shape), dtype=dtype, device=device)
                          for _ in range(num_layers)] if snapshots else []
        self.snap_ssm = [torch.zeros((snapshots, *ssm_shape), dtype=torch.float32,
                                     device=device) for _ in range(num_layers)] if snapshots else []
        self.snapshot_of: dict[bytes, int] = {}
        self.snap_free = list(range(snapshots - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.conv[0].shape[0] if self.conv else 0

    def forget(self, request_ids: Iterable[str]) -> None:
        """Give back the slots of finished or aborted sequences."""
        for rid in request_ids:
            slot = self.slot_of.pop(rid, None)
            if slot is not None:
                self.free.append(slot)

    def _take(self, rid: str) -> int:
        if not self.free:
            self._grow()
        slot = self.free.pop()
        self.slot_of[rid] = slot
        return slot

    def _grow(self) -> None:
        """Double the slots, keeping every held state where it is."""
        old = self.capacity
        self.conv = [torch.cat([t, torch.zeros_like(t)]) for t in self.conv]
        self.ssm = [torch.cat([t, torch.zeros_like(t)]) for t in self.ssm]
        self.free = list(range(2 * old - 1, old - 1, -1)) + self.free

    def _zero(self, slots: list[int]) -> None:
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        for t in (*self.conv, *self.ssm):
            t.index_fill_(0, idx, 0)

    def step(self, reqs: Sequence[ScheduledRequest]) -> MambaStep:
        """Each row's slot (a new sequence takes one, zeroed), the rows split into the
        mixers' batched one-token rows and their one-sequence prompt rows."""
        slots, fresh = [], []
        for r in reqs:
            slot = self.slot_of.get(r.request_id)
            if slot is None:
                if r.num_computed_tokens and r.restore_state is None:
                    raise ValueError(
                        f"request {r.request_id} resumes at token {r.num_computed_tokens} "
                        "without its Mamba state: a recurrent model cannot continue from "
                        "cached or shipped KV alone")
                slot = self._take(r.request_id)
            if r.restore_state is not None:  # (a prefix hit: the state where it ends)
                self._restore(r.request_id, r.restore_state, slot)
            elif r.num_computed_tokens == 0:
                fresh.append(slot)
            slots.append(slot)
        if fresh:
            self._zero(fresh)
        q_lens = [len(r.token_ids) for r in reqs]
        single_rows, single_slots, multi, row = [], [], [], 0
        for q, slot in zip(q_lens, slots):
            if q == 1:
                single_rows.append(row)
                single_slots.append(slot)
            else:
                multi.append((row, q, slot))
            row += q
        rows = None if not multi else torch.tensor(single_rows, dtype=torch.long,
                                                   device=self.device)
        return MambaStep(self.conv, self.ssm,
                         torch.tensor(single_slots, dtype=torch.long, device=self.device),
                         rows, multi)

    def _restore(self, rid: str, h: bytes, slot: int) -> None:
        snap = self.snapshot_of.get(h)
        if snap is None:
            raise ValueError(f"request {rid} resumes from a state snapshot this rank does "
                             "not hold (ranks out of step with the scheduler)")
        for live, kept in zip((*self.conv, *self.ssm), (*self.snap_conv, *self.snap_ssm),
                              strict=True):
            live[slot].copy_(kept[snap])

    def save(self, reqs: Sequence[ScheduledRequest]) -> None:
        """After the forward: keep a copy of each row's state that the plan names a
        snapshot (``save_state``; one already held under that hash is the same state)."""
        if not self.snap_conv:  # (prefix caching off: no row names one)
            return
        for r in reqs:
            h = r.save_state
            if h is None or h in self.snapshot_of:
                continue
            if not self.snap_free:
                raise RuntimeError(f"no room for a state snapshot of {len(self.snapshot_of)}: "
                                   "the scheduler's directory outgrew this rank's")
            snap = self.snapshot_of[h] = self.snap_free.pop()
            slot = self.slot_of[r.request_id]
            for live, kept in zip((*self.conv, *self.ssm), (*self.snap_conv, *self.snap_ssm),
                                  strict=True):
                kept[snap].copy_(live[slot])

    def drop(self, hashes: Iterable[bytes]) -> None:
        """Free the snapshots the scheduler's directory let go."""
        for h in hashes:
            snap = self.snapshot_of.pop(h, None)
            if snap is not None:
                self.snap_free.append(snap)

    def fork(self, parent: str, children: Iterable[str]) -> None:
        """Copy ``parent``'s state into a slot of each child (``n > 1`` siblings forking
        at the prompt's end)."""
        src = self.slot_of[parent]
        for child in children:
            dst = self.slot_of.get(child)
            if dst is None:
                dst = self._take(child)
            for t in (*self.conv, *self.ssm):
                t[dst].copy_(t[src])


def states_for(model: torch.nn.Module, capacity: int, snapshots: int = 0
               ) -> MambaStates | None:
    """Slots for ``model``'s recurrent mixers on this rank (``mamba_mixers()``: Mamba-2
    or gated DeltaNet, each with its ``state_index`` and ``state_shapes()``); None for a
    model without any."""
    mixers = model.mamba_mixers() if hasattr(model, "mamba_mixers") else []
    if not mixers:
        return None
    m = mixers[0]
    conv_shape, ssm_shape = m.state_shapes()
    weight = m.conv_weight
    return MambaStates(conv_shape, ssm_shape, len(mixers), weight.dtype, weight.device,
                       capacity, snapshots)

