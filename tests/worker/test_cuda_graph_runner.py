"""Decode through ``DecodeGraphRunner`` equals eager decode, and padding writes nothing.

The runner copies each decode batch into static buffers padded to a captured
size: padded rows get slot -1 (skipped by store-KV), a block table of block 0
and one key. On CUDA the captured graphs replay for real (``gpu`` test). On
CPU, where CUDA graphs do not exist, the capture is replaced by a stand-in
whose ``replay`` reruns the forward over the same static buffers: replay's
semantics, so the padding and buffer logic is still tested on every CI run.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.worker.cuda_graph import DecodeGraphRunner
from pagedserve.worker.worker import Worker
from tests.worker.helpers import (
    BlockAllocator,
    all_logits,
    make_worker,
    plan,
    request,
    save_tiny_model,
)

PROMPT_LENS = (3, 7, 4, 9, 1)
DECODE_BATCHES = (5, 5, 3, 2, 1, 4)  # padded sizes 8, 8, 4, 2, 1, 4
BLOCK_SIZE = 4


class _ReplayOnCpu:
    """Stands in for ``torch.cuda.CUDAGraph``: replay recomputes into the static output."""

    def __init__(self, runner: DecodeGraphRunner, b: int, out: torch.Tensor):
        self.runner, self.b, self.out = runner, b, out

    def replay(self) -> None:
        r, b = self.runner, self.b
        self.out.copy_(r.model(r.ids[:b], r.pos[:b], r.kv_cache.layers, r._md(b)))


def _capture_on_cpu(self: DecodeGraphRunner, b: int) -> tuple[_ReplayOnCpu, torch.Tensor]:
    """Like the real capture: a warm-up forward over the buffers as they are, then a graph."""
    out = self.model(self.ids[:b], self.pos[:b], self.kv_cache.layers, self._md(b))
    return _ReplayOnCpu(self, b, out), out


def _caches(w: Worker) -> list[torch.Tensor]:
    assert w.kv_cache is not None
    return [c.clone() for c in (*w.kv_cache.key_caches, *w.kv_cache.value_caches)]


def assert_graph_decode_matches_eager(w: Worker, atol: float, rtol: float) -> None:
    """Per decode step: eager logits, then the same step through the graph runner.

    The second pass rewrites the step's own K/V slots (same values up to rounding);
    every other slot of the pool must be bit-identical, so padded rows wrote nothing.
    """
    runner = w.runner
    assert runner is not None and runner.graphs is not None
    graphs = runner.graphs
    groups = w.kv_layout.num_groups
    alloc = BlockAllocator(w.kv_cache.num_blocks, BLOCK_SIZE, seed=3, groups=groups)
    g = torch.Generator().manual_seed(0)
    vocab = w.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    runner.graphs = None
    logits = all_logits(w, plan(0, [request(alloc, f"r{i}", p, 0)
                                     for i, p in enumerate(prompts)]))
    ends = torch.cumsum(torch.tensor(PROMPT_LENS), 0) - 1
    nxt = logits[ends].argmax(-1).tolist()
    computed = list(PROMPT_LENS)
    for step, active in enumerate(DECODE_BATCHES, start=1):
        p = plan(step, [request(alloc, f"r{i}", [nxt[i]], computed[i]) for i in range(active)])
        runner.graphs = None
        eager = all_logits(w, p)
        before = _caches(w)
        runner.graphs = graphs
        replayed = all_logits(w, p)
        torch.testing.assert_close(replayed, eager, atol=atol, rtol=rtol)
        touched = torch.tensor([alloc.tables[f"r{i}", gr][c // BLOCK_SIZE] * BLOCK_SIZE
                                + c % BLOCK_SIZE for i, c in enumerate(computed[:active])
                                for gr in range(groups)])
        for old, new in zip(before, _caches(w)):
            flat_old, flat_new = old.flatten(0, 1), new.flatten(0, 1)
            keep = torch.ones(flat_old.shape[0], dtype=torch.bool, device=flat_old.device)
            keep[touched.to(keep.device)] = False
            assert torch.equal(flat_old[keep], flat_new[keep]), f"step {step}: stray KV write"
            torch.testing.assert_close(flat_new[~keep], flat_old[~keep], atol=atol, rtol=rtol)
        for i in range(active):
            computed[i] += 1
            nxt[i] = int(eager[i].argmax())
    assert not graphs.disabled
    assert sorted(graphs.graphs) == [1, 2, 4, 8]


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_graph_runner_padding_on_cpu(tmp_path, monkeypatch, kind: str) -> None:
    """Also for a hybrid model (Gemma 3: a full layer between two sliding ones, three
    KV cache groups sharing one cache): each group's table and slots have buffers."""
    monkeypatch.setattr(DecodeGraphRunner, "_capture", _capture_on_cpu)
    extra = {} if kind == "llama" else dict(
        num_hidden_layers=3, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    w = make_worker(save_tiny_model(tmp_path, kind, **extra), num_blocks=64,
                    block_size=BLOCK_SIZE)
    assert w.runner is not None and w.runner.graphs is None  # CPU never builds one itself
    groups = w.kv_layout.num_groups
    assert groups == (1 if kind == "llama" else 3)
    w.runner.graphs = DecodeGraphRunner(w.model, w.kv_cache, w.device, max_num_seqs=8,
                                        max_blocks=16, num_groups=groups)
    assert_graph_decode_matches_eager(w, atol=1e-5, rtol=1e-5)


def test_capture_all_takes_every_size_and_writes_no_kv(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(DecodeGraphRunner, "_capture", _capture_on_cpu)
    w = make_worker(save_tiny_model(tmp_path), num_blocks=64, block_size=BLOCK_SIZE)
    order: list[int] = []
    real = DecodeGraphRunner._capture
    monkeypatch.setattr(DecodeGraphRunner, "_capture",
                        lambda self, b: order.append(b) or real(self, b))
    for c in (*w.kv_cache.key_caches, *w.kv_cache.value_caches):
        c.normal_()
    before = _caches(w)
    gr = DecodeGraphRunner(w.model, w.kv_cache, w.device, max_num_seqs=20, max_blocks=16)
    with torch.inference_mode():
        gr.capture_all()
    assert order == [20, 16, 8, 4, 2, 1]  # up to max_num_seqs, largest first
    assert sorted(gr.graphs) == sorted(order)
    assert all(torch.equal(a, b) for a, b in zip(before, _caches(w)))  # dummy rows: slot -1


def test_graph_runner_falls_back_beyond_its_sizes(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(DecodeGraphRunner, "_capture", _capture_on_cpu)
    w = make_worker(save_tiny_model(tmp_path), num_blocks=64, block_size=BLOCK_SIZE)
    gr = DecodeGraphRunner(w.model, w.kv_cache, w.device, max_num_seqs=2, max_blocks=2)
    alloc = BlockAllocator(64, BLOCK_SIZE)
    ids = torch.tensor([5, 6, 7])
    md = w.runner.prepare_inputs(plan(0, [request(alloc, f"r{i}", [5], 3)
                                          for i in range(3)])).md
    assert gr.run(ids, torch.tensor([3, 3, 3]), md) is None  # 3 rows > the largest size, 2
    md = w.runner.prepare_inputs(plan(0, [request(alloc, "long", [5], 12)])).md
    assert md.block_table.shape[1] == 4
    assert gr.run(ids[:1], torch.tensor([12]), md) is None  # 4 blocks wide > max_blocks 2
    assert not gr.graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-4), ("bfloat16", 6e-2)])
def test_cuda_graph_decode_matches_eager(tmp_path, dtype: str, atol: float) -> None:
    w = make_worker(save_tiny_model(tmp_path), num_blocks=64, block_size=BLOCK_SIZE,
                    device="cuda", dtype=dtype, attention_backend="triton",
                    enable_cuda_graph=True, max_num_seqs=8)
    assert w.runner is not None and w.runner.graphs is not None
    assert_graph_decode_matches_eager(w, atol=atol, rtol=atol)
