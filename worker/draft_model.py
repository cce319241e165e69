"""Speculative decoding with a draft model (vLLM's ``method="draft_model"``).

The draft is a small model sharing the target's tokenizer. It lives beside the
sampler only (rank 0 of the last pipeline stage), whole, with a KV pool of its own
over the target's block ids: a block the scheduler gives a request holds the
target's K/V on every rank and the draft's on this one, so prefix-cache hits,
copy-on-write, swaps and offloads move both without the scheduler knowing.

After each step's sampling, ``DraftRunner.run``:

1. catches up: one forward of every row's tokens that the target kept this step
   (a prompt chunk; a decode row's token and its accepted guesses), plus, for a
   row that proposes, the token it just sampled. The draft's KV is then valid up
   to the request's new length, as the target's is; a prefix this replica cached
   was computed by both. Tokens the row's last proposal already ran at the same
   positions in the same blocks are skipped: a decode row whose guesses were
   rejected runs only its new token;
2. proposes: ``k`` tokens per proposing row, the first from the catch-up's
   last logits, each next one from a one-token decode step whose KV lands in the
   row's lookahead slots (``ScheduledRequest.num_lookahead``).

A row that samples without a seed draws its guesses from the draft's distribution
``q`` under its own temperature and truncation, and the verifier applies
speculative sampling's rule with that ``q`` (``spec_sampling``): a ``q`` near the
target's keeps most guesses at any temperature, where a greedy guess survives only
with the target's probability of the draft's argmax (SmolLM2 drafted by its int8
copy at temperature 1: 17% kept greedy). Greedy and seeded rows get greedy guesses,
checked by drawing and matching (``Sampler.sample_drafted``), which is that rule for
a one-hot ``q`` and keeps a seeded request's tokens those it draws without drafts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.kernels import build_varlen_metadata, get_backend
from pagedserve.scheduler.kv_groups import plan_kv_groups
from pagedserve.scheduler.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.kv_cache import KVCache, bytes_per_block
from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.layers.packed import can_pack, pack_model
from pagedserve.worker.layers.quant import quantize_model
from pagedserve.worker.loaders import ResolvedModel, iter_safetensors, resolve_model
from pagedserve.worker.model_runner import int_tensor
from pagedserve.worker.models import MODEL_REGISTRY
from pagedserve.worker.parallel import ParallelContext
from pagedserve.worker.pipeline import PipelineStage
from pagedserve.worker.sampler import SampleRequest
from pagedserve.worker.sampling_ops import inverse_cdf
from pagedserve.worker.spec_sampling import draft_probs

logger = logging.getLogger(__name__)


@dataclass
class DraftModel:
    """A loaded draft: the model (one rank, every layer) and its config."""

    model: torch.nn.Module
    config: ModelConfig
    model_id: str


def load_draft_model(path: str, dtype: torch.dtype, device: torch.device,
                     attention_backend: str | None, quantization: str | None,
                     target: ModelConfig, packed_weights: bool = True,
                     hybrid: bool = True) -> DraftModel:
    """Build and load the draft named by ``speculative_config.model``; every reason it
    cannot draft for ``target`` is a ``ValueError`` naming that field."""
    resolved, mc = _resolve_checked(path, target, hybrid)
    backend = get_backend(attention_backend, device, kv_cache_dtype=dtype, model_dtype=dtype)
    stage = PipelineStage.of(mc.num_layers, 1, 0, None)
    model = MODEL_REGISTRY[mc.model_type](mc, ParallelContext(), backend, dtype, device, stage)
    tied = {id(model.embed_tokens.weight)}
    model.load_weights(iter_safetensors(resolved.path), (lambda name, layer: quantize_model(
        layer, quantization, tied, prefix=name + ".")) if quantization else None)
    if quantization:
        quantize_model(model, quantization, tied)
    model.eval()
    if packed_weights and can_pack(device, dtype):
        pack_model(model, tied)
    logger.info("draft model %s: %d layers, vocab %d", resolved.model_id, mc.num_layers,
                mc.vocab_size)
    return DraftModel(model, mc, resolved.model_id)


def check_draft(path: str, target_path: str, hybrid: bool = True) -> str:
    """Resolve the draft and check it can draft for the target at ``target_path``
    (the engine's early check, before any rank starts); returns its local path."""
    return _resolve_checked(path, ModelConfig.from_pretrained(target_path), hybrid)[0].path


def _resolve_checked(path: str, target: ModelConfig, hybrid: bool
                     ) -> tuple[ResolvedModel, ModelConfig]:
    try:
        resolved = resolve_model(path)
        mc = ModelConfig.from_pretrained(resolved.path)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"speculative_config.model {path!r}: {e}") from e
    why = _unfit(mc, target, hybrid)
    if why:
        raise ValueError(f"speculative_config.model {path!r}: {why}")
    return resolved, mc


def _unfit(mc: ModelConfig, target: ModelConfig, hybrid: bool) -> str | None:
    """Why ``mc`` cannot draft for ``target`` (None: it can). The draft reads the
    target's first block table (``hybrid``: a table per KV group, the first the
    full-attention layers' whenever the target has any), so a target that releases
    blocks behind a window needs a draft whose every layer looks no further back."""
    if mc.model_type not in MODEL_REGISTRY:
        return f"model_type {mc.model_type!r} is not supported"
    if mc.image is not None or mc.headless:
        return "a draft must be a text-generation model"
    if mc.mamba is not None:
        return "a hybrid recurrent model cannot draft (its drafting keeps no per-guess state)"
    if mc.prequant is not None:
        return (f"a {mc.prequant.method} checkpoint cannot draft: give its dense "
                "checkpoint, with speculative_config.quantization for a small one")
    if mc.vocab_size > target.vocab_size:
        return (f"its vocabulary ({mc.vocab_size}) is larger than the target's "
                f"({target.vocab_size}): the two must share a tokenizer")
    kept = plan_kv_groups(_windows(target), hybrid).windows[0]
    reach = None if None in _windows(mc) else max(_windows(mc))
    if kept is not None and (reach is None or reach > kept):
        return (f"it attends {'to every token' if reach is None else f'{reach} tokens back'}"
                f", but the target's block table keeps only its sliding window of {kept} "
                "(blocks behind it are released)")
    return None


def _windows(mc: ModelConfig) -> list[int | None]:
    return [mc.layer_window(i) for i in range(mc.num_layers)]


def draft_block_bytes(draft: DraftModel, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one block of the draft's KV pool (every layer, every KV head)."""
    mc = draft.config
    return bytes_per_block(mc.num_layers, block_size, mc.num_kv_heads, mc.head_dim, kv_dtype,
                           shared_kv=mc.mla is not None)


def kept_tokens(r: ScheduledRequest, out: ModelRunnerOutput
                ) -> tuple[list[int], int | None] | None:
    """A row's tokens the target kept this step (a decode row's token and its accepted
    guesses; all of a prompt chunk) and the token it sampled after them (None: it
    sampled none for itself); None for a drafted row the runner did not answer."""
    tokens, rid = list(r.token_ids), r.request_id
    if r.draft_token_ids:
        kept = out.spec_tokens.get(rid)
        if not kept:
            return None
        return tokens[:len(kept)], kept[-1].token_id
    if r.sample_ids == [rid] and rid in out.sampled:
        return tokens, out.sampled[rid].token_id
    return tokens, None


def unseeded_params(r: ScheduledRequest) -> SamplingParams | None:
    """The row's params if it samples without a seed (its guesses are drawn from the
    drafter's ``q``), else None (greedy guesses)."""
    prm = r.sampling_params.get(r.request_id)
    return prm if prm is not None and not prm.greedy and prm.seed is None else None


@dataclass(frozen=True)
class _Held:
    """What a row's last proposal left in the draft's pool: K/V of ``tokens`` (the
    sampled token, then all guesses but the last) from position ``start``, in the
    blocks ``blocks`` (the table's ids from ``start``'s block on)."""

    start: int
    tokens: tuple[int, ...]
    blocks: tuple[int, ...]


class DraftRunner:
    """Runs the draft after each step; see the module docstring."""

    def __init__(self, draft: DraftModel, kv_cache: KVCache, device: torch.device,
                 num_speculative_tokens: int, target_vocab: int) -> None:
        self.model, self.kv_cache, self.device = draft.model, kv_cache, device
        self.k = num_speculative_tokens
        self.block_size = kv_cache.block_size
        self.vocab = draft.config.vocab_size
        self.max_len = draft.config.max_model_len
        self.held: dict[str, _Held] = {}
        # (guesses, the distributions they were drawn from) of rows that sample
        self.probs: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
        self.target_vocab = target_vocab

    def apply_cache_ops(self, plan: SchedulerOutput) -> None:
        """The plan's swaps and copies, on the draft's pool (the target's order)."""
        for rid in (*plan.finished_ids, *plan.aborted_ids):
            self.held.pop(rid, None)
            self.probs.pop(rid, None)
        self.kv_cache.swap_out(plan.blocks_to_swap_out)
        self.kv_cache.swap_in(plan.blocks_to_swap_in)
        self.kv_cache.copy(plan.blocks_to_copy)

    @torch.inference_mode()
    def run(self, plan: SchedulerOutput, out: ModelRunnerOutput,
            hidden: torch.Tensor | None = None) -> dict[str, list[int]]:
        """Catch the draft up on the step's kept tokens; return each proposing row's
        ``k`` guesses.

        A decode row's leading tokens that the row's last proposal already ran (its
        sampled token and the accepted guesses, at the same positions in the same
        blocks) are skipped: after a rejection only the new token is left to run.
        (``hidden``, the target's hidden states, is for heads that read them.)"""
        rows: list[tuple[list[int], int, list[int]]] = []  # tokens, first position, table
        proposing: list[tuple[int, str]] = []  # (index into rows, request id)
        params: list[SamplingParams | None] = []  # a proposing row's, if it samples unseeded
        for r in plan.scheduled:
            rid = r.request_id
            got = kept_tokens(r, out)
            if got is None:
                continue
            tokens, last = got
            start = r.num_computed_tokens
            skip = self._skippable(self.held.pop(rid, None), start, tokens, r.block_table)
            tokens, start = tokens[skip:], start + skip
            if (last is not None and r.num_lookahead >= self.k
                    and start + len(tokens) + self.k <= self.max_len):
                tokens.append(last)
                proposing.append((len(rows), rid))
                params.append(unseeded_params(r))
            if tokens:
                rows.append((tokens, start, r.block_table))
        if not rows:
            return {}
        logits = self._forward(rows, [i for i, _ in proposing])
        if not proposing:
            return {}
        qs: list[list[torch.Tensor]] = [[] for _ in proposing]
        guesses = [self._pick(logits, params, qs)]
        live = [rows[i] for i, _ in proposing]
        tables = self._step_tables(live)
        for j in range(1, self.k):
            step = self._step_rows(live, guesses[-1], j)
            guesses.append(self._pick(self._forward(step, list(range(len(step))), tables),
                                      params, qs))
        drafts = self._hold_probs(proposing, guesses, qs)
        bsz = self.block_size
        for (toks, start, table), (_, rid), d in zip(live, proposing, drafts):
            at = start + len(toks) - 1  # the sampled token's position
            last = at + self.k - 1  # guess k-1's (the last guess is never run)
            self.held[rid] = _Held(at, (toks[-1], *d[:-1]),
                                   tuple(table[at // bsz:last // bsz + 1]))
        return {rid: d for (_, rid), d in zip(proposing, drafts)}

    def _step_tables(self, live: list[tuple[list[int], int, list[int]]]
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One block table (on the CPU, on the device) for the ``k - 1`` one-token steps
        after the catch-up of rows ``live``: it reaches the last guess run (the kernels
        read each row only up to its length). None when ``k`` is 1."""
        if self.k == 1:
            return None
        table = self._table([bt for _, _, bt in live],
                            [start + len(toks) + self.k - 1 for toks, start, _ in live])
        return table, table.to(self.device)

    @staticmethod
    def _step_rows(live: list[tuple[list[int], int, list[int]]], last: torch.Tensor,
                   j: int) -> list[tuple[list[int], int, list[int]]]:
        """One-token step ``j``'s rows: row i's guess ``j - 1`` sits at (its catch-up's
        end) + j - 1."""
        return [([int(t)], start + len(toks) + j - 1, bt)
                for (toks, start, bt), t in zip(live, last.tolist())]

    def _hold_probs(self, proposing: list[tuple[int, str]], guesses: list[torch.Tensor],
                    qs: list[list[torch.Tensor]]) -> list[list[int]]:
        """Each proposing row's guesses as lists, keeping the distributions sampled
        rows drew them from until the verifier asks (``attach_probs``)."""
        drafts = torch.stack(guesses, 1).tolist()
        for (_, rid), d, q in zip(proposing, drafts, qs):
            if q:
                self.probs[rid] = (tuple(d), torch.stack(q))
            else:
                self.probs.pop(rid, None)
        return drafts

    def _pick(self, logits: torch.Tensor, params: list[SamplingParams | None],
              qs: list[list[torch.Tensor]]) -> torch.Tensor:
        """Each row's guess: a draw from its ``q`` (the draft's distribution under the
        request's temperature and truncation, kept in ``qs`` for the verifier) for
        rows that sample unseeded, else the argmax."""
        tokens = logits.argmax(-1)
        rows = [i for i, prm in enumerate(params) if prm is not None]
        if not rows:
            return tokens
        rows_t = torch.tensor(rows, device=logits.device)
        q = draft_probs(logits.index_select(0, rows_t), [params[i] for i in rows],
                        self.target_vocab)  # type: ignore[misc]
        tokens[rows_t] = inverse_cdf(q.clone(), torch.rand(len(rows), device=q.device),
                                     in_place=True)
        for j, i in enumerate(rows):
            qs[i].append(q[j])
        return tokens

    def attach_probs(self, drafted: list[SampleRequest]) -> None:
        """Give each drafted row the distributions its guesses were drawn from, if it
        verifies the proposal they came from (else it draws and matches)."""
        for r in drafted:
            held = self.probs.pop(r.request_id, None)
            drafts = tuple(r.draft_token_ids or ())
            if held is not None and drafts and held[0][:len(drafts)] == drafts:
                r.draft_probs = held[1][:len(drafts)]

    def _skippable(self, held: _Held | None, start: int, tokens: list[int],
                   table: list[int]) -> int:
        """How many of a row's leading tokens the draft's pool holds already."""
        if held is None or held.start != start:
            return 0
        first = start // self.block_size
        if tuple(table[first:first + len(held.blocks)]) != held.blocks:
            return 0  # swapped, copied or recomputed since: other blocks
        n = 0
        for a, b in zip(tokens, held.tokens):
            if a != b:
                break
            n += 1
        return n

    def _table(self, tables: list[list[int]], lens: list[int]) -> torch.Tensor:
        """Each row's blocks for its first ``lens[i]`` positions, -1 padded (int32, CPU)."""
        bsz = self.block_size
        width = max(-(-n // bsz) for n in lens)
        flat: list[int] = []
        for i, (bt, n) in enumerate(zip(tables, lens)):
            need = -(-n // bsz)
            if len(bt) < need:
                raise ValueError(f"draft row {i}: block table has {len(bt)} blocks, "
                                 f"{n} tokens need {need}")
            flat += bt[:need]
            flat += [-1] * (width - need)
        return int_tensor(flat, np.int32).view(len(tables), width)

    def _forward(self, rows: list[tuple[list[int], int, list[int]]], want: list[int],
                 tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One forward of ``rows`` (tokens, first position, block table) through the
        draft's pool; the logits of the last token of rows ``want``. ``tables`` (on the
        CPU, on the device) reach at least each row's end: built here when None."""
        ids, positions, md, last = self._inputs(rows, tables)
        hidden = self.model(ids, positions, self.kv_cache.layers, md)
        if not want:
            return hidden[:0]
        return self.model.compute_logits(hidden.index_select(0, last[want]))

    def _inputs(self, rows: list[tuple[list[int], int, list[int]]],
                tables: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Token ids, positions and attention metadata of ``rows`` on the device, and
        each row's last token's index into them."""
        bsz, dev = self.block_size, self.device
        q_lens = [len(t) for t, _, _ in rows]
        seq_lens = [s + q for (_, s, _), q in zip(rows, q_lens)]
        if tables is None:
            table = self._table([bt for _, _, bt in rows], seq_lens)
            tables = (table, table.to(dev))
        table = tables[0]
        q_t = torch.tensor(q_lens)
        first = torch.cumsum(q_t, 0) - q_t
        starts = torch.tensor([s for _, s, _ in rows])
        seq_idx = torch.repeat_interleave(torch.arange(len(rows)), q_t)
        positions = torch.arange(int(q_t.sum())) - torch.repeat_interleave(first - starts, q_t)
        slots = table[seq_idx, positions // bsz].long() * bsz + positions % bsz
        ids = int_tensor([t for toks, _, _ in rows for t in toks], np.int64)
        ids.clamp_(max=self.vocab - 1)  # (an image placeholder may lie past the draft's)
        is_decode = all(q == 1 for q in q_lens)
        md = AttentionMetadata(
            slot_mapping=slots.to(dev), block_table=tables[1],
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            is_decode=is_decode,
            varlen=None if is_decode else build_varlen_metadata(q_lens, seq_lens, dev))
        return ids.to(dev), positions.to(dev), md, (first + q_t - 1).to(dev)
