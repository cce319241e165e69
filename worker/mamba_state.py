"""Each sequence's recurrent state in a hybrid model's Mamba-2 (Mamba-1, gated DeltaNet,
short convolution) layers, on one rank.

Attention layers page their KV through the scheduler's block tables; a Mamba layer
instead folds everything a sequence has seen into a fixed-size state: its causal
convolution's last ``d_conv - 1`` inputs and an SSM state ``[heads, head_dim,
d_state]`` (Mamba-1's ``[channels, d_state]``; fp32: it is summed into at every
token, and rounding it to 16 bits every step would drift). A gated DeltaNet layer
(Qwen3-Next) keeps the same two parts, its "SSM" tensor the ``[value heads, key
dim, value dim]`` fast-weight matrix of the delta rule. Each sequence holds one slot of per-layer tensors here
from its first step until the plan names it finished or aborted.

The slots are this rank's own bookkeeping, not the scheduler's: every rank of an
engine sees the same plans in the same order, so each assigns the same slots, and
nothing on the wire changes. What the scheduler does still maps onto them:

- a step that starts a sequence at token 0 (a new request, or one preempted by
  recompute and now run again) zeroes its slot;
- swap preemption moves only KV blocks: the state stays in its slot meanwhile;
- a row that samples for siblings (``n > 1``) hands each its own copy of the
  state at the prompt's end (``fork``), as the scheduler forks their blocks;
- a row that verifies draft tokens (speculative decoding) runs them one position
  at a time through the one-token update, keeping its state after each guess; the
  scheduler learns only from the sampler how many it kept, so the row's next plan
  names that count (``draft_state``) and the step starts from the state kept there
  (vLLM keeps the same per-guess states for its Mamba layers);
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
from dataclasses import dataclass, field

import torch

from pagedserve.scheduler.outputs import ScheduledRequest


@dataclass
class MambaStep:
    """One step's rows, as every Mamba layer of the forward reads them.

    ``batches`` are the one-token updates, in order, each ``(flat rows, slots)``
    (rows None: every row of the step, in order): first the rows that compute one
    token (decodes, one-token prompts) with the first token of each row that
    verifies guesses, then each later position of those rows, one batch a
    position. After batch ``j`` a mixer calls ``keep(its state_index, j)``, which
    copies the verifying rows' states (``kept[j]``, their slots) aside. ``multi``
    lists the rest as ``(first flat row, tokens, slot)``: each runs the chunked
    scan on its own.
    """

    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]
    batches: list[tuple[torch.Tensor | None, torch.Tensor]]
    multi: list[tuple[int, int, int]]
    kept: list[torch.Tensor] = field(default_factory=list)
    owner: MambaStates | None = None

    def keep(self, index: int, j: int, conv: bool = True, ssm: bool = True) -> None:
        """Copy the state after batch ``j`` of the rows that verify guesses, in layer
        ``index``, where a later rollback finds it (nothing without guesses). A mixer
        that runs its convolutions and its scans in two passes keeps each part after
        its own pass (``conv`` / ``ssm`` False skip one)."""
        if j < len(self.kept) and self.owner is not None:
            self.owner.keep(index, j, self.kept[j], conv, ssm)


class MambaStates:
    """Slots of per-layer conv and SSM state, one slot per live sequence."""

    def __init__(self, conv_shape: tuple[int, int], ssm_shape: tuple[int, ...],
                 num_layers: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 8, snapshots: int = 0, guesses: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if snapshots < 0:
            raise ValueError(f"snapshots must be >= 0, got {snapshots}")
        if guesses < 0:
            raise ValueError(f"guesses must be >= 0, got {guesses}")
        self.conv_shape, self.ssm_shape = conv_shape, ssm_shape
        self.dtype, self.device = dtype, device
        self.conv = [torch.zeros((capacity, *conv_shape), dtype=dtype, device=device)
                     for _ in range(num_layers)]
        self.ssm = [torch.zeros((capacity, *ssm_shape), dtype=torch.float32, device=device)
                    for _ in range(num_layers)]
        # Speculative decoding: each slot's states after its guesses 0 .. guesses - 1
        # of its last verifying step, ``[capacity * guesses, ...]`` (slot-major).
        self.guesses = guesses
        self.draft_conv = [torch.zeros((capacity * guesses, *conv_shape), dtype=dtype,
                                       device=device) for _ in range(num_layers)]
        self.draft_ssm = [torch.zeros((capacity * guesses, *ssm_shape), dtype=torch.float32,
                                      device=device) for _ in range(num_layers)]
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
        self.draft_conv = [torch.cat([t, torch.zeros_like(t)]) for t in self.draft_conv]
        self.draft_ssm = [torch.cat([t, torch.zeros_like(t)]) for t in self.draft_ssm]
        self.free = list(range(2 * old - 1, old - 1, -1)) + self.free

    def _zero(self, slots: list[int]) -> None:
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        for t in (*self.conv, *self.ssm):
            t.index_fill_(0, idx, 0)

    def step(self, reqs: Sequence[ScheduledRequest]) -> MambaStep:
        """Each row's slot (a new sequence takes one, zeroed; one whose last step kept
        fewer guesses than it verified goes back to the state after those), the rows
        split into the mixers' batches of one-token updates and their one-sequence
        prompt rows."""
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
            elif r.draft_state is not None:
                self._roll_back(r.request_id, slot, r.draft_state)
            if r.restore_state is not None:  # (a prefix hit: the state where it ends)
                self._restore(r.request_id, r.restore_state, slot)
            elif r.num_computed_tokens == 0:
                fresh.append(slot)
            slots.append(slot)
        if fresh:
            self._zero(fresh)
        single_rows, single_slots, multi, row = [], [], [], 0
        drafted: list[tuple[int, int, int]] = []  # (first flat row, tokens, slot)
        for r, slot in zip(reqs, slots):
            q = len(r.token_ids)
            if q == 1 or r.draft_token_ids:
                single_rows.append(row)
                single_slots.append(slot)
                if q > 1:
                    self._check_guesses(r.request_id, q - 1)
                    drafted.append((row, q, slot))
            else:
                multi.append((row, q, slot))
            row += q
        batches: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        if single_slots:
            rows = None if not multi and not drafted else self._longs(single_rows)
            batches.append((rows, self._longs(single_slots)))
        kept = []  # (after position j: the slots of rows with a guess past it)
        for j in range(max((q for _, q, _ in drafted), default=0)):
            if j:
                batches.append((self._longs([start + j for start, q, _ in drafted if q > j]),
                                self._longs([slot for _, q, slot in drafted if q > j])))
            if j < self.guesses:
                kept.append(self._longs([slot for _, q, slot in drafted if q > j + 1]))
        return MambaStep(self.conv, self.ssm, batches, multi, kept, self)

    def _longs(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _check_guesses(self, rid: str, n: int) -> None:
        if n > self.guesses:
            raise ValueError(f"request {rid} verifies {n} draft tokens, but this rank keeps "
                             f"the states of {self.guesses} (num_speculative_tokens)")

    def keep(self, index: int, j: int, slots: torch.Tensor, conv: bool = True,
             ssm: bool = True) -> None:
        """Copy layer ``index``'s states of ``slots`` (the convolution's, the SSM's or
        both) aside as their states after guess position ``j`` (``MambaStep.keep``)."""
        if not slots.numel():
            return
        at = slots * self.guesses + j
        if conv:
            self.draft_conv[index].index_copy_(0, at, self.conv[index].index_select(0, slots))
        if ssm:
            self.draft_ssm[index].index_copy_(0, at, self.ssm[index].index_select(0, slots))

    def _roll_back(self, rid: str, slot: int, kept: int) -> None:
        """Put back the state ``slot`` had after the first token and ``kept`` guesses of
        its last verifying step (the rest were rejected)."""
        if not 0 <= kept < self.guesses:
            raise ValueError(f"request {rid}: no state kept after {kept} guesses (this rank "
                             f"keeps {self.guesses})")
        at = slot * self.guesses + kept
        for live, kept_t in zip((*self.conv, *self.ssm), (*self.draft_conv, *self.draft_ssm),
                                strict=True):
            live[slot].copy_(kept_t[at])

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


def states_for(model: torch.nn.Module, capacity: int, snapshots: int = 0, guesses: int = 0
               ) -> MambaStates | None:
    """Slots for ``model``'s recurrent mixers on this rank (``mamba_mixers()``: Mamba-2
    or gated DeltaNet, each with its ``state_index`` and ``state_shapes()``), with room
    for ``snapshots`` prefix-cache copies and each slot's states after ``guesses``
    draft tokens; None for a model without any."""
    mixers = model.mamba_mixers() if hasattr(model, "mamba_mixers") else []
    if not mixers:
        return None
    m = mixers[0]
    conv_shape, ssm_shape = m.state_shapes()
    weight = m.conv_weight
    return MambaStates(conv_shape, ssm_shape, len(mixers), weight.dtype, weight.device,
                       capacity, snapshots, guesses)

