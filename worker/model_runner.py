"""Turn a ``SchedulerOutput`` into tensors, run one forward, sample on rank 0.

This is the per-step hot path (hundreds of sequences every few tens of
milliseconds), so inputs are built with a handful of list concatenations and
vectorised tensor ops rather than per-token Python loops, and the LM head runs
only on the last token of rows that sample (on every token of rows that verify
draft tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedserve.kernels import build_varlen_metadata
from pagedserve.scheduler.outputs import (
    ImageChunk,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from pagedserve.worker.cuda_graph import DecodeGraphRunner
from pagedserve.worker.encoder_cache import EncoderCache
from pagedserve.worker.kv_cache import KVCache
from pagedserve.worker.layers.attention import AttentionMetadata
from pagedserve.worker.layers.lora import LoRAManager
from pagedserve.worker.layers.moe import take_expert_load
from pagedserve.worker.layers.rotary import mark_long_rope
from pagedserve.worker.mamba_state import states_for
from pagedserve.worker.models.llama import LlamaForCausalLM
from pagedserve.worker.models.multimodal import encode_picture
from pagedserve.worker.mrope_positions import step_positions
from pagedserve.worker.parallel import ParallelContext
from pagedserve.worker.pipeline import IntermediateTensors
from pagedserve.worker.pooling import PoolJob, pool_hidden
from pagedserve.worker.prompt_logprobs import PromptLogprobJob, compute_prompt_logprobs
from pagedserve.worker.sampler import Sampler, SampleRequest

if TYPE_CHECKING:
    from pagedserve.worker.draft_model import DraftRunner


@dataclass
class ModelInputs:
    """Flat batch tensors of one step; ``logits_indices`` are the rows that need logits."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    md: AttentionMetadata
    logits_indices: torch.Tensor
    sample_reqs: list[SampleRequest]
    prompt_logprob_jobs: list[PromptLogprobJob]
    drafted_reqs: list[SampleRequest]
    pool_jobs: list[PoolJob]
    images: list[tuple[int, ImageChunk]] | None = None  # (first flat row, what it takes)


class ModelRunner:
    """Executes step plans against one rank's model and KV cache shard."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, ctx: ParallelContext,
                 device: torch.device, sampler: Sampler | None = None,
                 enable_cuda_graph: bool = False, max_num_seqs: int = 256,
                 lora: LoRAManager | None = None, drafter: DraftRunner | None = None,
                 state_snapshots: int = 0, guesses: int = 0):
        self.model, self.kv_cache, self.ctx, self.device = model, kv_cache, ctx, device
        self.lora = lora
        self.drafter = drafter  # (on the rank that samples, with a draft model)
        self.encoder_cache = EncoderCache()  # (new weights get a new runner: a fresh one)
        self.block_size = kv_cache.block_size
        self.sampler = sampler or Sampler(model.config.eos_token_ids)
        self.long_rope = (model.config.rope_scaling or {}).get("rope_type") == "longrope"
        self.mrope = bool(model.config.mrope_section)
        self.graphs: DecodeGraphRunner | None = None
        # A hybrid model's per-sequence Mamba state (``mamba_state``), with its prefix
        # cache's snapshots and the states after each of ``guesses`` draft tokens;
        # None: KV only.
        self.states = states_for(model, max_num_seqs, state_snapshots, guesses)
        # The torch reference backend reads lengths back to the host, which graph
        # capture forbids; the Triton and flash paths are sync-free.
        # A pipeline stage runs eagerly: its input or output is not a whole forward's.
        if (enable_cuda_graph and device.type == "cuda" and kv_cache.backend.name != "torch"
                and model.graph_capturable and model.stage.size == 1):
            max_blocks = -(-model.config.max_model_len // self.block_size)
            groups = max(a.kv_group for a in model.attention_layers()) + 1
            self.graphs = DecodeGraphRunner(model, kv_cache, device, max_num_seqs, max_blocks,
                                            groups)
            with torch.inference_mode():
                self.graphs.capture_all()
        take_expert_load(model)  # profiling and warm-up passes are not served work

    def prepare_inputs(self, plan: SchedulerOutput) -> ModelInputs:
        """Build input ids, positions, slot mapping, -1 padded block tables and metadata."""
        reqs = plan.scheduled
        bsz, dev = self.block_size, self.device
        q_lens = [len(r.token_ids) for r in reqs]
        if 0 in q_lens:
            raise ValueError(f"request {reqs[q_lens.index(0)].request_id} has no tokens to compute")
        starts = [r.num_computed_tokens for r in reqs]
        seq_lens = [s + q for s, q in zip(starts, q_lens)]
        num_tokens = sum(q_lens)
        width = -(-max(seq_lens) // bsz)
        block_table = _block_table(reqs, [r.block_table for r in reqs], seq_lens, bsz, width)
        input_ids = int_tensor(list(chain.from_iterable(r.token_ids for r in reqs)), np.int64)
        is_decode = num_tokens == len(reqs)
        if is_decode:
            positions = torch.tensor(starts, dtype=torch.long)
            seq_idx = torch.arange(len(reqs))
        else:
            q_t = torch.tensor(q_lens)
            first = torch.cumsum(q_t, 0) - q_t  # row offset of each sequence's first token
            shift = torch.repeat_interleave(first - torch.tensor(starts), q_t)
            positions = torch.arange(num_tokens) - shift
            seq_idx = torch.repeat_interleave(torch.arange(len(reqs)), q_t)
        tables = [block_table]
        if reqs[0].group_block_tables is not None:  # a hybrid model: one table per group
            for g in range(len(reqs[0].group_block_tables)):
                tables.append(_block_table(reqs, [_group_table(r, g) for r in reqs],
                                           seq_lens, bsz, width))
        block, offset = positions // bsz, positions % bsz
        slots = [t[seq_idx, block].long() * bsz + offset for t in tables]
        if self.long_rope:
            positions = mark_long_rope(positions, seq_idx, [r.long_rope for r in reqs])
        if self.mrope:
            positions = step_positions(reqs, q_lens, positions, seq_idx)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        varlen = None if is_decode else build_varlen_metadata(q_lens, seq_lens, dev)
        mds = [AttentionMetadata(slot_mapping=s.to(dev), block_table=t.to(dev), seq_lens=lens,
                                 is_decode=is_decode, varlen=varlen)
               for t, s in zip(tables, slots, strict=True)]
        md = mds[0]
        if len(mds) > 1:
            md.groups = mds[1:]
        if self.states is not None:
            md.mamba = self.states.step(reqs)
        rows: list[int] = []
        images: list[tuple[int, ImageChunk]] = []  # (first flat row, what it takes)
        sample_reqs: list[SampleRequest] = []
        drafted: list[SampleRequest] = []
        jobs: list[PromptLogprobJob] = []
        pool_jobs: list[PoolJob] = []
        end = 0
        for r, q in zip(reqs, q_lens):
            if r.pooling is not None:
                pool_jobs.append(PoolJob(r.request_id, end, end + q, r.pooling,
                                         r.num_computed_tokens, r.pool_task))
            if r.prompt_logprob_targets:
                params = r.sampling_params[r.request_id]
                k = params.prompt_logprobs or 0
                jobs.append(PromptLogprobJob(r.request_id, end, r.num_computed_tokens + 1,
                                             r.prompt_logprob_targets, k))
            if r.images:
                images.extend((end + c.offset, c) for c in r.images)
            end += q
            if not r.sample_ids:
                continue
            if r.draft_token_ids:  # every position verifies a guess (or follows the last)
                rid = r.request_id
                if r.sample_ids != [rid]:
                    raise ValueError(f"request {rid}: draft tokens on a row that samples "
                                     f"for {r.sample_ids}")
                out = r.output_token_ids.get(rid)
                drafted.append(SampleRequest(rid, rid, len(rows), r.sampling_params[rid],
                                             r.num_output_tokens, out,
                                             r.prompt_token_ids, list(r.draft_token_ids)))
                rows.extend(range(end - q, end))
                continue
            row = len(rows)
            rows.append(end - 1)
            for sid in r.sample_ids:
                params = r.sampling_params.get(sid) or r.sampling_params.get(r.request_id)
                if params is None:
                    raise ValueError(f"request {r.request_id}: no sampling params for {sid!r}")
                out = r.output_token_ids.get(sid)
                done = r.num_output_tokens if sid == r.request_id else 0
                sample_reqs.append(SampleRequest(sid, r.request_id, row, params, done,
                                                 out, r.prompt_token_ids))
        if images:
            image_cfg = self.model.config.image
            spans = [r.image_spans or [] for r in reqs]
            # (LLaVA's images stay causal, as do prompt embeddings: no spans)
            if image_cfg is not None and image_cfg.bidirectional and any(spans):
                for m in mds:
                    m.image_spans = spans
            for row, chunk in images:  # placeholders may lie past the vocabulary
                input_ids[row:row + chunk.count] = 0
        return ModelInputs(
            input_ids=input_ids.to(dev),
            positions=positions.to(dev),
            md=md,
            logits_indices=torch.tensor(rows, dtype=torch.long, device=dev),
            sample_reqs=sample_reqs,
            prompt_logprob_jobs=jobs,
            drafted_reqs=drafted,
            pool_jobs=pool_jobs,
            images=images or None,
        )

    def forward_hidden(self, inputs: ModelInputs,
                       intermediate: IntermediateTensors | None = None
                       ) -> torch.Tensor | IntermediateTensors:
        """Final hidden states for every token of the step (CUDA graph for decode if
        captured; steps with LoRA rows run eagerly, since their grouping varies, and so
        do the step that calibrates fp8 KV scales and, under an EAGLE-3 head, every
        step: it keeps three layers' inputs, which a graph would not). A pipeline
        stage before the last returns what the next stage continues from."""
        lora_rows = self.lora is not None and self.lora.batch.groups
        if (self.graphs is not None and inputs.md.is_decode and not lora_rows
                and not self.model.kv_scales_pending and not self.model.aux_layers):
            out = self.graphs.run(inputs.input_ids, inputs.positions, inputs.md)
            if out is not None:
                return out
        return self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.md,
                          intermediate, image_embeds=self._image_embeds(inputs))

    def _image_embeds(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's image rows and the vision encoder's embeddings for them: each
        image of the step encoded once (or taken from the encoder cache, where an
        earlier step or request encoded the same picture), the rows its chunk computes
        taken. Images are encoded one at a time: an image is thousands of patch rows
        already, and its embeddings then do not depend on what else the step holds
        (batch invariance)."""
        if not inputs.images or not self.model.stage.is_first:
            return None  # a later pipeline stage continues from hidden states
        vision = self.model.vision
        feats: dict[str, torch.Tensor] = {}
        for _, chunk in inputs.images:
            if chunk.key in feats:
                continue
            if chunk.is_embeds:  # a client's own rows: nothing to encode
                feats[chunk.key] = torch.as_tensor(chunk.pixels).to(self.device)
                continue
            if vision is None:
                raise ValueError("a request has images, but this model serves text only")
            feats[chunk.key] = self.encoder_cache.get(
                chunk.key, lambda c=chunk: encode_picture(vision, c.pixels, self.device))
        rows = torch.cat([torch.arange(row, row + c.count) for row, c in inputs.images])
        embeds = torch.cat([feats[c.key][c.first:c.first + c.count] for _, c in inputs.images])
        return rows.to(self.device), embeds

    def _set_lora_batch(self, plan: SchedulerOutput) -> None:
        """Tell the projections which rows run with which LoRA adapter this step."""
        ids = [r.lora_id for r in plan.scheduled]
        if self.lora is None:
            if any(ids):
                raise ValueError("a request asks for a LoRA adapter, but LoRA is not enabled")
            return
        self.lora.set_batch(ids, [len(r.token_ids) for r in plan.scheduled])

    def apply_cache_ops(self, plan: SchedulerOutput) -> None:
        """Swap-out, swap-in, then copy: the order the scheduler's block reuse relies on."""
        self.kv_cache.swap_out(plan.blocks_to_swap_out)
        self.kv_cache.swap_in(plan.blocks_to_swap_in)
        self.kv_cache.copy(plan.blocks_to_copy)
        if self.drafter is not None:
            self.drafter.apply_cache_ops(plan)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, intermediate: IntermediateTensors | None = None
                ) -> ModelRunnerOutput | IntermediateTensors | None:
        """Apply the plan's cache ops, run the forward, and sample (rank 0 only returns).

        A pipeline stage before the last stops after its layers: its rank 0 returns
        the hidden states on the host for the next stage (every rank of a stage holds
        the same ones), and only the last stage samples.
        """
        done = list(plan.finished_ids) + list(plan.aborted_ids)
        if done:
            self.sampler.forget(done)
            if self.states is not None:
                self.states.forget(done)
        self.apply_cache_ops(plan)
        samples = self.ctx.is_first and self.model.stage.is_last
        out = ModelRunnerOutput(step_id=plan.step_id) if samples else None
        if not plan.scheduled:
            if self.states is not None:
                self.states.drop(plan.dropped_states)
            return out
        if self.lora is not None and len({r.lora_id for r in plan.scheduled}) > 1:
            # Rows of one adapter side by side: each adapter's delta is one slice's matmuls.
            plan = replace(plan, scheduled=sorted(plan.scheduled, key=lambda r: r.lora_id))
        inputs = self.prepare_inputs(plan)
        self._set_lora_batch(plan)
        try:
            hidden = self.forward_hidden(inputs, intermediate)
        finally:
            if self.lora is not None:
                self.lora.clear_batch()
        if self.states is not None:  # siblings (n > 1) leave the prompt's end with its state
            for r in plan.scheduled:
                if len(r.sample_ids) > 1:
                    self.states.fork(r.request_id,
                                     [s for s in r.sample_ids if s != r.request_id])
            self.states.drop(plan.dropped_states)  # (prefix caching: room, then copies)
            self.states.save(plan.scheduled)
        # Every rank's, rank 0's reported (its routing counts every rank's expert load).
        counters = self.kv_cache.backend.take_counters() | take_expert_load(self.model)
        if isinstance(hidden, IntermediateTensors):
            return hidden.to(torch.device("cpu")) if self.ctx.is_first else None
        if out is not None:
            out.counters = counters
        if inputs.prompt_logprob_jobs:
            prompt_lps = compute_prompt_logprobs(self.model, hidden, inputs.prompt_logprob_jobs)
            if out is not None and prompt_lps is not None:
                out.prompt_logprobs = prompt_lps
        if inputs.pool_jobs and out is not None:
            out.pooled = pool_hidden(hidden, inputs.pool_jobs,
                                     getattr(self.model, "score", None),
                                     getattr(self.model, "task_heads", None))
        if inputs.logits_indices.numel():
            logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
            if out is None or logits is None:
                return None
            out.sampled = self.sampler.sample(logits, inputs.sample_reqs)
            if inputs.drafted_reqs:
                if self.drafter is not None:
                    self.drafter.attach_probs(inputs.drafted_reqs)
                out.spec_tokens = self.sampler.sample_drafted(logits, inputs.drafted_reqs)
        if self.drafter is not None and out is not None:
            out.draft_tokens = self.drafter.run(plan, out, hidden)
        return out


def int_tensor(values: list[int], dtype: type[np.integer]) -> torch.Tensor:
    """A CPU tensor of Python ints, read by numpy's ``fromiter`` (C, a known count).

    Why: ``torch.tensor`` on a list converts each int on its own path, several times
    slower; for a decode step's block tables at long contexts (256 rows x 512 blocks)
    ``prepare_inputs`` took 5.3 ms that way against 1.6 ms this way, on every rank
    every step (``python bench/prepare_inputs.py``)."""
    return torch.from_numpy(np.fromiter(values, dtype=dtype, count=len(values)))


def _block_table(reqs: list[ScheduledRequest], tables: list[list[int]], seq_lens: list[int],
                 bsz: int, width: int) -> torch.Tensor:
    """``tables`` cut to each row's blocks and padded with -1 to ``width``, as int32."""
    pad = [-1] * width
    flat: list[int] = []
    for r, bt, n in zip(reqs, tables, seq_lens):
        need = -(-n // bsz)
        if len(bt) < need:
            raise ValueError(
                f"request {r.request_id}: block table has {len(bt)} blocks, "
                f"{n} tokens need {need}"
            )
        flat += bt[:need]
        flat += pad[: width - need]
    return int_tensor(flat, np.int32).view(len(reqs), width)


def _group_table(r: ScheduledRequest, group: int) -> list[int]:
    if r.group_block_tables is None or len(r.group_block_tables) <= group:
        raise ValueError(f"request {r.request_id}: no block table for KV cache group "
                         f"{group + 1}")
    return r.group_block_tables[group]
