"""Prompt logprobs: each prompt token's logprob given the tokens before it.

Requests that ask for them (``SamplingParams.prompt_logprobs``) get logits for
every row of their prefill chunks, not only the last. A 49k-token vocabulary
makes that 200 KB per row in fp32, so rows go through the LM head in slices.
Every rank runs the same calls (the vocab-parallel head gathers across
ranks); rank 0 alone gets logits back and builds the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.scheduler.outputs import PromptLogprobs
from pagedserve.worker.models.llama import LlamaForCausalLM

ROWS_PER_SLICE = 256


@dataclass(slots=True)
class PromptLogprobJob:
    """Rows ``first_row ..`` of the step predict ``targets``, prompt positions ``first_position ..``."""

    request_id: str
    first_row: int
    first_position: int
    targets: list[int]
    top_k: int


def compute_prompt_logprobs(model: LlamaForCausalLM, hidden: torch.Tensor,
                            jobs: list[PromptLogprobJob]) -> dict[str, PromptLogprobs] | None:
    """``{request_id: (first position, [{token: logprob}, ...], [rank, ...])}`` on rank
    0, else None.

    Each entry holds the target token and the ``top_k`` likeliest tokens, as vLLM's
    prompt logprobs do; ``rank`` is the target's (1 + the tokens likelier than it),
    which vLLM's HTTP answer carries and the top ``k`` alone cannot tell.
    """
    result: dict[str, PromptLogprobs] = {}
    rank0 = True
    for job in jobs:
        entries: list[dict[int, float]] = []
        ranks: list[int] = []
        for lo in range(0, len(job.targets), ROWS_PER_SLICE):
            targets = job.targets[lo : lo + ROWS_PER_SLICE]
            rows = hidden[job.first_row + lo : job.first_row + lo + len(targets)]
            logits = model.compute_logits(rows)
            if logits is None:
                rank0 = False
                continue
            lp = torch.log_softmax(logits.float(), dim=-1)
            t = torch.tensor(targets, device=lp.device)
            chosen_t = lp.gather(1, t.unsqueeze(1))
            chosen = chosen_t.squeeze(1).tolist()
            ranks += ((lp > chosen_t).sum(dim=1) + 1).tolist()
            if job.top_k > 0:
                top_v, top_i = (x.tolist() for x in lp.topk(job.top_k, dim=-1))
            else:
                top_v, top_i = [[]] * len(targets), [[]] * len(targets)
            for j, target in enumerate(targets):
                entry = dict(zip(top_i[j], top_v[j]))
                entry[target] = chosen[j]
                entries.append(entry)
        result[job.request_id] = (job.first_position, entries, ranks)
    return result if rank0 else None
