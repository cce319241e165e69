"""A token-level KV simulator for scheduler tests.

It stores, per slot, the token whose K/V would be there, applies swaps and
copies in the worker's order, and "samples" a token that depends on every
token it reads back through the block table, exactly as attention would.
A wrong block table, a missed copy-on-write or a stale swap therefore
changes the outputs, which the tests compare against an unconstrained run.
"""

from __future__ import annotations

from pagedserve.scheduler.outputs import ModelRunnerOutput, SampledToken, SchedulerOutput

VOCAB = 1000
EOS = 999


def context_hash(context: list[int]) -> int:
    h = 0
    for t in context:
        h = (h * 31 + t + 1) % 1_000_003
    return h


def distribution(context: list[int], k: int) -> dict[int, float]:
    """The "model's" ``k`` likeliest next tokens and their log-probabilities, likeliest
    first (distinct tokens, strictly falling); EOS is second in one context of five."""
    h = context_hash(context)
    tokens = [(h + 101 * j) % VOCAB for j in range(k)]
    if h % 5 == 0 and EOS not in tokens and k > 1:
        tokens[1] = EOS
    out: dict[int, float] = {}
    logprob = 0.0
    for j, t in enumerate(tokens):
        logprob -= 0.01 + ((h // (j + 1)) % 17) * 0.05
        out[t] = logprob
    return out


class KVSim:
    """``copy_period``: the "model" mostly repeats the token that many places back
    (3 times in 4, chosen by the context hash), so n-gram drafts are often right
    and speculative decoding's accept and reject paths both run. With ``window`` it
    reads only the last ``window`` positions, as sliding-window attention does, and
    fails on a table entry there that was released (-1). With ``group_windows`` (a
    hybrid model's KV cache groups) each step writes through every group's table and
    reads each group's window back through its own; the token follows group 0's
    reading, and every other group's must be the end of it."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 copy_period: int | None = None, window: int | None = None,
                 group_windows: tuple[int | None, ...] = ()) -> None:
        self.windows = tuple(group_windows) or (window,)
        self.B = block_size
        self.gpu: list[list[int | None]] = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu: list[list[int | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.copy_period = copy_period

    def _next(self, sr, end: int, index: int) -> int:
        """The token after the first ``end`` positions, read back through the block table."""
        context = self._context(sr, end)
        h = context_hash(context)
        p = self.copy_period
        if p is not None and len(context) >= p and h % 4:
            return context[-p]
        return (h + 7 * index) % VOCAB

    def _context(self, sr, end: int) -> list[int]:
        context = self._read(sr, 0, end)
        for g in range(1, len(self.windows)):
            seen = self._read(sr, g, end)
            assert seen == context[len(context) - len(seen):], f"{sr.request_id} group {g}"
        return context

    def _read(self, sr, group: int, end: int) -> list[int]:
        window = self.windows[group]
        table = _table(sr, group)
        first = 0 if window is None else max(0, end - window)
        blocks = [table[p // self.B] for p in range(first, end)]
        assert min(blocks, default=0) >= 0, f"{sr.request_id} reads a released block"
        context = [self.gpu[b][p % self.B] for b, p in zip(blocks, range(first, end))]
        assert None not in context, f"{sr.request_id} read an unwritten slot"
        return context

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        for dev, cpu in plan.blocks_to_swap_out:
            self.cpu[cpu] = list(self.gpu[dev])
        for dev, cpu in plan.blocks_to_swap_in:
            self.gpu[dev] = list(self.cpu[cpu])
        for src, dst in plan.blocks_to_copy:
            self.gpu[dst] = list(self.gpu[src])
        out = ModelRunnerOutput(plan.step_id)
        for sr in plan.scheduled:
            for g in range(len(self.windows)):
                table = _table(sr, g)
                for i, tok in enumerate(sr.token_ids):
                    p = sr.num_computed_tokens + i
                    self.gpu[table[p // self.B]][p % self.B] = tok
            end = sr.num_computed_tokens + len(sr.token_ids)
            if sr.draft_token_ids:  # the sampler's rule: keep guesses up to a differing draw
                drafts, toks = sr.draft_token_ids, []
                index = _index(sr.request_id)
                for j in range(len(drafts) + 1):
                    toks.append(SampledToken(self._next(sr, end - len(drafts) + j, index)))
                    if j == len(drafts) or toks[-1].token_id != drafts[j]:
                        break
                out.spec_tokens[sr.request_id] = toks
                continue
            for sid in sr.sample_ids:
                sp = sr.sampling_params.get(sid)
                if sp is not None and sp.logprobs:  # a beam's row: the top candidates
                    top = distribution(self._context(sr, end), sp.logprobs)
                    first = next(iter(top))
                    out.sampled[sid] = SampledToken(first, top[first], top)
                else:
                    out.sampled[sid] = SampledToken(self._next(sr, end, _index(sid)))
        return out


def _table(sr, group: int) -> list[int]:
    return sr.block_table if group == 0 else sr.group_block_tables[group - 1]


def _index(sample_id: str) -> int:
    """A sibling's index in its group (siblings must draw differently)."""
    return int(sample_id.rsplit("#", 1)[1]) if "#" in sample_id else 0
