"""Speculative decoding with an EAGLE / EAGLE-3 head (``models.eagle``): loading it
beside the target, and running it after each step.

The head keeps a KV pool of its own over the target's block ids, as a draft model
does (``draft_model``), and drafts the same way: a catch-up forward over what the
step kept, then ``k - 1`` one-token steps into the row's lookahead slots. What
differs is its input. Position ``p`` runs the token at ``p + 1`` with the target's
feature of ``p``, so the catch-up covers the step's positions shifted by one: a row
that sampled runs all its kept positions (the last with the token it sampled); a
prompt chunk before the last runs all but its last position, whose feature waits
(``pending``) for the next chunk's first token. Every kept position runs again with
the target's features, so nothing a guess left in the pool is reused. A row that
ends an ``n > 1`` prompt leaves its last feature to each sibling's first step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.kernels import get_backend
from pagedserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.draft_model import (
    DraftModel,
    DraftRunner,
    kept_tokens,
    unseeded_params,
)
from pagedserve.worker.kv_cache import KVCache
from pagedserve.worker.layers.linear import LazyTensor
from pagedserve.worker.layers.packed import can_pack, pack_model
from pagedserve.worker.loaders import BIN_CHECKPOINT, iter_safetensors, resolve_model
from pagedserve.worker.loaders.hf import checkpoint_names
from pagedserve.worker.models.eagle import EagleHead, EagleSpec, read_eagle_spec
from pagedserve.worker.models.llama import LlamaForCausalLM
from pagedserve.worker.parallel import ParallelContext

logger = logging.getLogger(__name__)

Row = tuple[list[int], int, list[int]]  # token ids, first position, block table


def check_eagle(path: str, method: str, target_path: str) -> str:
    """Resolve the head and check it fits the target at ``target_path`` (the engine's
    early check, before any rank starts); returns its local path."""
    local, _ = _resolve(path, method, ModelConfig.from_pretrained(target_path))
    return local


def _resolve(path: str, method: str, target: ModelConfig) -> tuple[str, EagleSpec]:
    try:
        local = resolve_model(path, allow_bin=True).path
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"speculative_config.model {path!r}: {e}") from e
    return local, read_eagle_spec(local, method, target)


def load_eagle_head(path: str, method: str, target: LlamaForCausalLM, target_path: str,
                    ctx: ParallelContext, dtype: torch.dtype, device: torch.device,
                    attention_backend: str | None, packed_weights: bool = True) -> DraftModel:
    """Build and load the head named by ``speculative_config.model`` for ``target``
    (this rank's model: the last stage's rank 0). EAGLE-3 also makes the target keep
    its three layers' inputs each forward (``aux_layers``)."""
    local, spec = _resolve(path, method, target.config)
    if spec.aux_layers and target.stage.size > 1:
        raise ValueError(f"speculative_config.model {path!r}: EAGLE-3 reads layers of "
                         "every pipeline stage; run it with pipeline_parallel_size 1")
    names, tensors = _head_tensors(local)
    names = {n.removeprefix("model.") for n in names}
    whole = ctx.world_size == 1 and target.embed_tokens is not None \
        and target.lm_head is not None
    backend = get_backend(attention_backend, device, kv_cache_dtype=dtype, model_dtype=dtype)
    head = EagleHead(spec, backend, dtype, device,
                     target.embed_tokens if whole else None,
                     target.lm_head if whole else None,
                     fc_bias="fc.bias" in names,
                     embed_in_checkpoint="embed_tokens.weight" in names)
    head.load_weights(tensors)
    if head.needs_target_tensors:
        head.load_target_tensors(iter_safetensors(target_path),
                                 target.config.tie_word_embeddings)
    head.eval()
    if packed_weights and can_pack(device, dtype):
        pack_model(head.layer)
        if head.own_head:
            pack_model(head.lm_head)
    head.attach(target)
    logger.info("%s head %s for a %d-layer target%s", method, path, target.config.num_layers,
                f", reading layers {list(spec.aux_layers)}" if spec.aux_layers else "")
    return DraftModel(head, spec.config, path)


def _head_tensors(local: str) -> tuple[set[str], Iterable[tuple[str, LazyTensor]]]:
    """The head's tensor names, and its tensors: safetensors read lazily, else
    ``pytorch_model.bin`` (as most heads are published; one layer, memory-mapped)."""
    if any(Path(local).glob("*.safetensors")):
        return checkpoint_names(local), iter_safetensors(local)
    state = torch.load(Path(local) / BIN_CHECKPOINT, map_location="cpu", weights_only=True,
                       mmap=True)
    return set(state), state.items()


@dataclass(frozen=True)
class _Catchup:
    """One row's catch-up: its shifted token ids from ``start``, and where their
    features come from (a waiting feature first, then target rows ``lo:hi``)."""

    row: Row
    waiting: torch.Tensor | None
    lo: int
    hi: int


class EagleRunner(DraftRunner):
    """Runs an EAGLE head after each step; see the module docstring."""

    def __init__(self, draft: DraftModel, kv_cache: KVCache, device: torch.device,
                 num_speculative_tokens: int, target: LlamaForCausalLM) -> None:
        super().__init__(draft, kv_cache, device, num_speculative_tokens,
                         target.config.vocab_size)
        self.head: EagleHead = draft.model  # type: ignore[assignment]
        self.target = target
        self.max_len = target.config.max_model_len
        # request id -> (position, feature) of a position that waits for its next token
        self.pending: dict[str, tuple[int, torch.Tensor]] = {}

    def apply_cache_ops(self, plan: SchedulerOutput) -> None:
        for rid in (*plan.finished_ids, *plan.aborted_ids):
            self.pending.pop(rid, None)
        super().apply_cache_ops(plan)

    @torch.inference_mode()
    def run(self, plan: SchedulerOutput, out: ModelRunnerOutput,
            hidden: torch.Tensor | None = None) -> dict[str, list[int]]:
        """Catch the head up on the step's kept positions with the target's features
        (``hidden``: its final hidden states, one row per token of the step); return
        each proposing row's ``k`` guesses."""
        if hidden is None:
            raise ValueError("an EAGLE head needs the target's hidden states")
        feats = self._target_features(hidden)
        rows: list[_Catchup] = []
        proposing: list[tuple[int, str]] = []
        params: list[SamplingParams | None] = []
        base = 0
        for r in plan.scheduled:
            rid = r.request_id
            lo, base = base, base + len(r.token_ids)
            got = kept_tokens(r, out)
            if got is None:
                continue
            tokens, nxt = got
            start, end = r.num_computed_tokens, r.num_computed_tokens + len(tokens)
            ids = tokens[1:]
            waiting = self.pending.pop(rid, None)
            first = start
            if waiting is not None and waiting[0] == start - 1:
                ids.insert(0, tokens[0])
                first = start - 1
            if nxt is None:
                for sid in r.sample_ids or [rid]:
                    self.pending[sid] = (end - 1, feats[lo + len(tokens) - 1].clone())
            else:
                ids.append(nxt)
            hi = lo + len(tokens) - (nxt is None)
            if not ids:
                continue
            if (nxt is not None and r.num_lookahead >= self.k
                    and end + self.k <= self.max_len):
                proposing.append((len(rows), rid))
                params.append(unseeded_params(r))
            rows.append(_Catchup((ids, first, r.block_table),
                                 waiting[1] if first < start else None, lo, hi))
        if not rows:
            return {}
        pieces: list[torch.Tensor] = []
        for c in rows:
            if c.waiting is not None:
                pieces.append(c.waiting[None])
            pieces.append(feats[c.lo:c.hi])
        want = [i for i, _ in proposing]
        logits, fed = self._run(
            [c.row for c in rows], torch.cat(pieces), want, None)
        if not proposing:
            return {}
        qs: list[list[torch.Tensor]] = [[] for _ in proposing]
        guesses = [self._pick(logits, params, qs)]
        live = [rows[i].row for i in want]
        tables = self._step_tables(live)
        for j in range(1, self.k):
            step = self._step_rows(live, guesses[-1], j)
            logits, fed = self._run(step, fed, list(range(len(step))), tables)
            guesses.append(self._pick(logits, params, qs))
        drafts = self._hold_probs(proposing, guesses, qs)
        return {rid: d for (_, rid), d in zip(proposing, drafts)}

    def _target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's features of every token of the step, as the head takes them:
        EAGLE's are its final hidden states; EAGLE-3's its three layers' inputs,
        joined by the head's ``fc``."""
        if not self.head.eagle3:
            return hidden
        aux = self.target.aux_hidden
        layers = self.head.spec.aux_layers
        if any(i not in aux for i in layers):
            raise RuntimeError(f"the target kept no inputs of layers {list(layers)} for "
                               "the EAGLE-3 head")
        return self.head.combine(torch.cat([aux[i] for i in layers], -1))

    def _run(self, rows: list[Row], features: torch.Tensor, want: list[int],
             tables: tuple[torch.Tensor, torch.Tensor] | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of ``rows`` with ``features`` (one per token); the logits and
        the next features at the last token of rows ``want``."""
        ids, positions, md, last = self._inputs(rows, tables)
        for_logits, fed = self.head(ids, positions, features, self.kv_cache.layers, md)
        if not want:
            return for_logits[:0], fed[:0]
        idx = last[want]
        return self.head.compute_logits(for_logits.index_select(0, idx)), fed.index_select(0, idx)
