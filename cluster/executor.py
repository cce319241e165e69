"""Executors run one step plan on every rank and return the sampling rank's tokens.

``LocalExecutor`` holds a single rank in-process (offline use, tests, TP=1
serving); ``RayExecutor`` holds the ranks as Ray actors in one placement
group. The engine talks to both through the same five calls.
"""

from __future__ import annotations

import abc
import itertools
import logging
import os
from dataclasses import replace
from typing import Any

from pagedserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from pagedserve.scheduler.plan_wire import PlanEncoder
from pagedserve.worker.worker import Worker
from pagedserve.worker.worker_config import WorkerConfig

logger = logging.getLogger(__name__)


class ExecutorDeadError(RuntimeError):
    """A rank died or failed a step; the replica must be replaced."""


class Executor(abc.ABC):
    """The engine's view of its tensor-parallel group."""

    # How many plans may be in flight at once (``submit_model`` before ``collect``).
    max_concurrent_batches: int = 1

    @abc.abstractmethod
    def model_info(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def determine_num_blocks(self) -> int: ...

    @abc.abstractmethod
    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None: ...

    @abc.abstractmethod
    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput | None: ...

    def submit_model(self, plan: SchedulerOutput) -> Any:
        """Start a step and return a handle for ``collect``; plans run in the order they
        are submitted. Here the step runs now; a pipeline returns at once."""
        return self.execute_model(plan)

    def collect(self, handle: Any) -> ModelRunnerOutput | None:
        """Wait for a submitted step's output."""
        return handle

    @abc.abstractmethod
    def read_kv_blocks(self, block_ids: list[int]) -> list[tuple[Any, ...]]:
        """Every rank's K and V of device blocks, in rank order (see ``KVCache``); the
        rank holding a draft model adds the draft's K and V."""

    @abc.abstractmethod
    def write_kv_blocks(self, block_ids: list[int], shards: list[tuple[Any, ...]]) -> None:
        """Write each rank its shard of shipped K and V (``read_kv_blocks``'s result)."""

    @abc.abstractmethod
    def sleep(self, level: int) -> None:
        """Free every rank's KV shard (level 2: the weights too); see ``worker.sleep``."""

    @abc.abstractmethod
    def wake_up(self) -> None: ...

    @abc.abstractmethod
    def update_weights(self, model: str) -> None:
        """Every rank loads its shard of ``model``; ``ValueError`` if one refuses it."""

    @abc.abstractmethod
    def add_lora(self, lora_id: int, path: str) -> None:
        """Load an adapter on every rank; ``ValueError`` if any rank cannot serve it."""

    @abc.abstractmethod
    def remove_lora(self, lora_id: int) -> None: ...

    @abc.abstractmethod
    def check_health(self) -> None: ...

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release the ranks; safe to call twice."""


class LocalExecutor(Executor):
    """One rank in this process."""

    def __init__(self, worker_config: WorkerConfig) -> None:
        self.worker = Worker(worker_config)
        self.worker.load_model()

    def model_info(self) -> dict[str, Any]:
        return self.worker.get_model_info()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.init_kv_cache(num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.worker.execute_model(plan)

    def read_kv_blocks(self, block_ids: list[int]) -> list[tuple[Any, ...]]:
        return [self.worker.read_kv_blocks(block_ids)]

    def write_kv_blocks(self, block_ids: list[int], shards: list[tuple[Any, ...]]) -> None:
        shard, = shards
        self.worker.write_kv_blocks(block_ids, *shard)

    def sleep(self, level: int) -> None:
        self.worker.sleep(level)

    def wake_up(self) -> None:
        self.worker.wake_up()

    def update_weights(self, model: str) -> None:
        self.worker.update_weights(model)

    def add_lora(self, lora_id: int, path: str) -> None:
        self.worker.add_lora(lora_id, path)

    def remove_lora(self, lora_id: int) -> None:
        self.worker.remove_lora(lora_id)

    def check_health(self) -> None:
        self.worker.check_health()

    def shutdown(self) -> None:
        self.worker.shutdown()


class RayExecutor(Executor):
    """TP ranks (of every pipeline stage) as Ray actors placed in one placement group.

    Inside a Serve replica deployed with ``placement_group_bundles`` the
    replica occupies bundle 0 and the ranks take bundles 1..world; otherwise the
    executor creates (and later removes) its own group. Ranks are numbered stage by
    stage; each stage is its own process group: its rank 0 reports its address and a
    free port, and that stage's ranks join ``tcp://ip:port``. Stages pass hidden
    states through Ray's object store, so they need no process group between them.
    """

    def __init__(self, worker_config: WorkerConfig, use_gpu: bool,
                 ready_timeout_s: float = 300.0) -> None:
        import ray
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pagedserve.worker.ray_worker import RayWorkerWrapper

        if not ray.is_initialized():
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(include_dashboard=False, log_to_driver=False)
        tp, pp = worker_config.tensor_parallel_size, worker_config.pipeline_parallel_size
        world = tp * pp
        bundle = {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0}
        pg = get_current_placement_group()
        self._own_pg = None
        offset = 0
        if pg is not None and len(pg.bundle_specs) >= world + 1:
            offset = 1
        else:
            pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
            ray.get(pg.ready(), timeout=ready_timeout_s)
            self._own_pg = pg
        self._ray = ray
        self.max_concurrent_batches = pp  # one micro-batch per stage
        self._step_seq = itertools.count()
        self._wire = PlanEncoder()  # plans travel as changes (scheduler/plan_wire.py)
        self.workers = []
        for i in range(world):
            actor_cls = ray.remote(RayWorkerWrapper).options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                # A health check answers next to one running step and the
                # ``max_concurrent_batches - 1`` waiting for their turn.
                max_concurrency=pp + 1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i + offset,
                    placement_group_capture_child_tasks=False,
                ),
            )
            cfg = replace(worker_config, rank=i % tp, pp_rank=i // tp)
            self.workers.append(actor_cls.remote(cfg))
        self.stages = [self.workers[s * tp:(s + 1) * tp] for s in range(pp)]
        # Rank 0 of the last stage samples: its result is the step's.
        self._sampler_index = (pp - 1) * tp
        addrs = self._get([stage[0].get_node_ip_and_free_port.remote() for stage in self.stages],
                          timeout=ready_timeout_s)
        self._get([w.load_model.remote(f"tcp://{ip}:{port}")
                   for stage, (ip, port) in zip(self.stages, addrs, strict=True)
                   for w in stage], timeout=ready_timeout_s)

    def _get(self, refs: Any, timeout: float | None = None) -> Any:
        try:
            return self._ray.get(refs, timeout=timeout)
        except Exception as e:  # RayActorError, GetTimeoutError, a rank's own error
            raise ExecutorDeadError(f"tensor-parallel group failed: {e}") from e

    def model_info(self) -> dict[str, Any]:
        """Rank 0's facts; with pipeline stages a block's bytes are the largest stage's
        (what sizes the swap tier must fit on every rank)."""
        infos = self._get([stage[0].get_model_info.remote() for stage in self.stages])
        info = dict(infos[0])
        info["bytes_per_block"] = max(int(i["bytes_per_block"]) for i in infos)
        return info

    def determine_num_blocks(self) -> int:
        return min(self._get([w.determine_num_blocks.remote() for w in self.workers]))

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self._get([w.init_kv_cache.remote(num_gpu_blocks, num_cpu_blocks)
                   for w in self.workers])

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.collect(self.submit_model(plan))

    def submit_model(self, plan: SchedulerOutput) -> list[Any]:
        """Every rank runs the plan; each stage after the first starts from the object
        its predecessor's rank 0 returns (Ray hands it over when it exists, so the
        driver submits the whole chain at once and waits only for the end). The
        plan's sequence number keeps every rank running plans in submission order
        while several are in flight (a threaded actor may receive them out of order)."""
        seq = next(self._step_seq)
        try:
            ref = self._ray.put(self._wire.encode(plan))
        except Exception as e:
            self._wire.reset()
            raise ExecutorDeadError(f"tensor-parallel group failed: {e}") from e
        refs: list[Any] = []
        previous = None
        for stage in self.stages:
            stage_refs = [w.execute_model.remote(ref, previous, seq) for w in stage]
            refs += stage_refs
            previous = stage_refs[0]
        return refs

    def collect(self, handle: list[Any]) -> ModelRunnerOutput | None:
        try:
            return self._get(handle)[self._sampler_index]
        except ExecutorDeadError:
            self._wire.reset()  # a rank may have missed the plan: the next goes whole
            raise

    def read_kv_blocks(self, block_ids: list[int]) -> list[tuple[Any, ...]]:
        return self._get([w.read_kv_blocks.remote(block_ids) for w in self.workers])

    def write_kv_blocks(self, block_ids: list[int], shards: list[tuple[Any, ...]]) -> None:
        self._get([w.write_kv_blocks.remote(block_ids, *shard)
                   for w, shard in zip(self.workers, shards, strict=True)])

    def sleep(self, level: int) -> None:
        self._on_every_rank("sleep", level)

    def wake_up(self) -> None:
        self._on_every_rank("wake_up")

    def update_weights(self, model: str) -> None:
        self._on_every_rank("update_weights", model)

    def add_lora(self, lora_id: int, path: str) -> None:
        self._on_every_rank("add_lora", lora_id, path)

    def _on_every_rank(self, method: str, *args: Any) -> None:
        """Call ``method`` on every rank; a rank's ``ValueError`` (it refused the call:
        the group itself is fine) is raised as is, anything else means a dead group."""
        try:
            self._ray.get([getattr(w, method).remote(*args) for w in self.workers])
        except ValueError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, ValueError):
                raise ValueError(str(cause)) from None
            raise
        except Exception as e:
            raise ExecutorDeadError(f"tensor-parallel group failed: {e}") from e

    def remove_lora(self, lora_id: int) -> None:
        self._get([w.remove_lora.remote(lora_id) for w in self.workers])

    def check_health(self) -> None:
        self._get([w.check_health.remote() for w in self.workers], timeout=30)

    def shutdown(self) -> None:
        for w in self.workers:
            try:
                self._ray.kill(w)
            except Exception:  # already dead
                logger.debug("worker already gone", exc_info=True)
        self.workers = []
        if self._own_pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._own_pg)
            self._own_pg = None
