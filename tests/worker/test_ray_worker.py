"""The Ray actor wrapper: two actors form a gloo TP group and match an in-process TP=1 run."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from pagedserve.worker.worker_config import WorkerConfig
from tests.worker.helpers import BlockAllocator, make_worker, plan, request, save_tiny_model

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def test_two_ray_actors_tp2(tmp_path, ray_local):
    from pagedserve.worker.ray_worker import RayWorker

    ray = ray_local
    path = save_tiny_model(tmp_path / "m", "llama", seed=8)
    cfg = WorkerConfig(model=str(path), block_size=4, num_gpu_blocks=16, num_cpu_blocks=4,
                       tensor_parallel_size=2, num_threads=1)
    actors = [RayWorker.options(num_cpus=1).remote(replace(cfg, rank=r)) for r in range(2)]
    try:
        ip, port = ray.get(actors[0].get_node_ip_and_free_port.remote(), timeout=120)
        ray.get([a.load_model.remote(f"tcp://{ip}:{port}") for a in actors], timeout=120)
        info = ray.get(actors[0].get_model_info.remote())
        assert info["tensor_parallel_size"] == 2 and info["num_kv_heads_per_rank"] == 1
        n = min(ray.get([a.determine_num_blocks.remote() for a in actors]))
        ray.get([a.init_kv_cache.remote(n, 4) for a in actors])
        ref = make_worker(path, num_blocks=16, block_size=4)
        prompt = [3, 14, 15, 92, 65, 35]
        toks, ref_toks = [], []
        alloc, ref_alloc = BlockAllocator(16, 4), BlockAllocator(16, 4)
        for step in range(4):
            computed = len(prompt) + len(toks) - (len(prompt) if step == 0 else 1)
            new = prompt if step == 0 else toks[-1:]
            p = plan(step, [request(alloc, "r", new, 0 if step == 0 else computed)])
            outs = ray.get([a.execute_model.remote(p) for a in actors])
            assert outs[1] is None
            toks.append(outs[0].sampled["r"].token_id)
            new_ref = prompt if step == 0 else ref_toks[-1:]
            rp = plan(step, [request(ref_alloc, "r", new_ref, 0 if step == 0 else computed)])
            ref_toks.append(ref.execute_model(rp).sampled["r"].token_id)
        assert toks == ref_toks
        assert all(h["ok"] for h in ray.get([a.check_health.remote() for a in actors]))
        ray.get([a.shutdown.remote() for a in actors])
    finally:
        for a in actors:
            ray.kill(a)


def test_wrapper_computes_on_one_thread_whichever_actor_thread_calls(tmp_path, monkeypatch):
    """The actor has two threads; OpenMP pools are per thread, so every call that computes
    (building the worker included) must land on the wrapper's one compute thread."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from pagedserve.worker import ray_worker

    seen: dict[str, set[int]] = {}

    class SpyWorker(ray_worker.Worker):
        def __init__(self, *a, **kw):
            seen.setdefault("__init__", set()).add(threading.get_ident())
            super().__init__(*a, **kw)

    monkeypatch.setattr(ray_worker, "Worker", SpyWorker)
    path = save_tiny_model(tmp_path / "m", "llama", seed=3)
    callers = ThreadPoolExecutor(2)  # what max_concurrency=2 gives an actor
    w = callers.submit(ray_worker.RayWorkerWrapper,
                       WorkerConfig(model=str(path), block_size=4, num_gpu_blocks=16)).result()
    for name in ("load_model", "determine_num_blocks", "init_kv_cache", "execute_model"):
        real = getattr(w.worker, name)

        def spy(*a, _real=real, _name=name, **kw):
            seen.setdefault(_name, set()).add(threading.get_ident())
            return _real(*a, **kw)

        setattr(w.worker, name, spy)
    callers.submit(w.load_model).result()
    n = callers.submit(w.determine_num_blocks).result()
    callers.submit(w.init_kv_cache, n, 0).result()
    alloc = BlockAllocator(16, 4)
    futs = [callers.submit(w.execute_model, plan(0, [request(alloc, "r", [3, 14, 15], 0)]))]
    futs.append(callers.submit(w.check_health))
    assert futs[0].result().sampled["r"].token_id >= 0 and futs[1].result()["ok"]
    threads = set().union(*seen.values())
    assert len(seen) == 5 and len(threads) == 1
    assert threading.get_ident() not in threads
    callers.shutdown()
    w.shutdown()


def test_pipelined_plans_reach_the_worker_in_the_drivers_order(tmp_path, monkeypatch):
    """Plans in flight arrive on any of the actor's threads, in any order; the worker
    runs them by their ``seq``. A gap (an earlier stage failed, so Ray never calls
    this one with that plan) makes the later plan fail after the wait, not hang."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from pagedserve.worker import ray_worker

    path = save_tiny_model(tmp_path / "m", "llama", seed=3)
    w = ray_worker.RayWorkerWrapper(WorkerConfig(model=str(path), block_size=4,
                                                 num_gpu_blocks=16))
    w.load_model()
    w.init_kv_cache(16, 0)
    order: list[int] = []
    real = w.worker.execute_model

    def spy(p, intermediate=None):
        order.append(p.step_id)
        return real(p, intermediate)

    w.worker.execute_model = spy
    alloc = BlockAllocator(16, 4)
    plans = [plan(i, [request(alloc, f"r{i}", [3 + i, 14, 15], 0)]) for i in range(3)]
    callers = ThreadPoolExecutor(3)
    late = [callers.submit(w.execute_model, plans[i], None, i) for i in (2, 1)]
    deadline = time.monotonic() + 30
    while len(w._turn._waiters) < 2:  # both wait for plan 0 (CPython's Condition)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert order == [] and all(not f.done() for f in late)
    first = callers.submit(w.execute_model, plans[0], None, 0)
    assert all(f.result(timeout=60).sampled for f in [first, *late])
    assert order == [0, 1, 2]
    monkeypatch.setattr(ray_worker, "STEP_ORDER_TIMEOUT_S", 0.2)
    with pytest.raises(RuntimeError, match=r"step 4 waited .* for step 3, which never came"):
        w.execute_model(plan(4, []), None, 4)
    callers.shutdown()
    w.shutdown()
