"""One request's row of a step plan: the tokens to compute and what its sampling needs.

Kept apart from the batching policy in :mod:`scheduler`: this decides only
what travels to the workers for a request the policy already scheduled.
"""

from __future__ import annotations

from pagedserve.scheduler.long_rope import uses_long_rope
from pagedserve.scheduler.multimodal import chunk_images, mrope_grids
from pagedserve.scheduler.outputs import ScheduledRequest
from pagedserve.scheduler.request import Request


def scheduled_request(req: Request, num_new: int, block_ids: list[int],
                      group_block_ids: list[list[int]] | None = None,
                      history: bool = False) -> ScheduledRequest:
    """Tokens ``num_computed_tokens .. + num_new`` of ``req`` over its ``block_ids``
    (and a hybrid model's other groups' tables, ``group_block_ids``).

    The row samples only when it reaches the end of the sequence: for the
    sequence itself, or at a group's prompt end for every sibling waiting to
    fork. The token history goes along only when penalties or a grammar need it
    (``SamplingParams.needs_output_history``) or ``history`` asks for it (custom
    logits processors: the prompt's ids too), and the prompt tokens to score only
    for requests that asked for prompt logprobs. Draft tokens the scheduler
    proposed (``req.spec_token_ids``) follow a decode row's token.
    """
    start = req.num_computed_tokens
    rid = req.request_id
    drafts = req.spec_token_ids
    if drafts:  # a decode row: the last token, then the guesses that may follow it
        token_ids = [req.all_token_ids[start], *drafts]
        assert num_new == len(token_ids) and start + 1 == len(req.all_token_ids)
    else:
        token_ids = req.all_token_ids[start : start + num_new]
    if req.pooling_params is not None or start + num_new - len(drafts) != len(
            req.all_token_ids):
        sample_ids, params = [], {}
    elif not req.pending_children:
        sample_ids, params = [rid], {rid: req.sampling_params}
    else:
        family = [req, *req.pending_children]
        sample_ids = [r.request_id for r in family]
        params = {r.request_id: r.sampling_params for r in family}
    sched = ScheduledRequest(rid, token_ids, start, block_ids, sample_ids, params)
    if drafts:
        sched.draft_token_ids = drafts
    sched.lora_id = req.lora_id
    sched.group_block_tables = group_block_ids
    sched.long_rope = uses_long_rope(req)
    sched.num_output_tokens = req.num_output_tokens
    if req.images and start < req.images[-1].end and not drafts:
        chunks, spans = chunk_images(req.images, start, num_new)
        if chunks:
            sched.images, sched.image_spans = chunks, spans
        if req.rope_delta or any(img.grid for img in req.images):
            sched.mrope_grids = mrope_grids(req.images, start + num_new)
    sched.rope_delta = req.rope_delta
    pp = req.pooling_params
    if pp is not None:
        sched.pool_final = start + num_new == req.num_tokens
        sched.pool_task = pp.task
        kind = pp.pooling_type or "last"  # (the engine fills the model's in; alone: last)
        if kind in ("mean", "all", "splade") or (kind == "cls" and start == 0) or (
                kind == "last" and sched.pool_final):
            sched.pooling = kind
    sp = req.sampling_params
    if sample_ids and (sp.needs_output_history or history):
        # Siblings share the params; at the prompt's end none has an output yet.
        outputs = req.output_token_ids
        sched.output_token_ids = {sid: outputs if sid == rid else [] for sid in sample_ids}
        if sp.repetition_penalty != 1.0 or history:  # (embeddings' placeholders: no tokens)
            embeds = bool(req.images) and req.images[0].is_embeds
            sched.prompt_token_ids = [] if embeds else req.prompt_token_ids
    n_prompt = req.num_prompt_tokens
    if sp.prompt_logprobs is not None and start < n_prompt - 1:
        sched.prompt_logprob_targets = req.prompt_token_ids[
            start + 1 : min(start + num_new + 1, n_prompt)]
        sched.sampling_params.setdefault(rid, sp)  # the worker reads its top-k there
    return sched
