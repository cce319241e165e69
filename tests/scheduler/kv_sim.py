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


class KVSim:
    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int) -> None:
        self.B = block_size
        self.gpu: list[list[int | None]] = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu: list[list[int | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        for dev, cpu in plan.blocks_to_swap_out:
            self.cpu[cpu] = list(self.gpu[dev])
        for dev, cpu in plan.blocks_to_swap_in:
            self.gpu[dev] = list(self.cpu[cpu])
        for src, dst in plan.blocks_to_copy:
            self.gpu[dst] = list(self.gpu[src])
        out = ModelRunnerOutput(plan.step_id)
        for sr in plan.scheduled:
            for i, tok in enumerate(sr.token_ids):
                p = sr.num_computed_tokens + i
                self.gpu[sr.block_table[p // self.B]][p % self.B] = tok
            end = sr.num_computed_tokens + len(sr.token_ids)
            context = [self.gpu[sr.block_table[p // self.B]][p % self.B] for p in range(end)]
            assert None not in context, f"{sr.request_id} read an unwritten slot"
            h = 0
            for t in context:
                h = (h * 31 + t + 1) % 1_000_003
            for sid in sr.sample_ids:
                index = int(sid.rsplit("#", 1)[1]) if "#" in sid else 0
                out.sampled[sid] = SampledToken((h + 7 * index) % VOCAB)
        return out
