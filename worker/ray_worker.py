"""Ray actor wrapper around :class:`Worker`.

The cluster package creates the placement group and the actors
(``RayWorker.options(scheduling_strategy=..., num_gpus=...).remote(config)``);
this wrapper only forwards calls, so a Worker behaves the same in-process and
inside an actor. Rank 0's actor reports its address for the
``tcp://ip:port`` init method that every rank then passes to ``load_model``.

The actor runs with two threads or more (so a health check answers during a long
forward), but every call that computes runs on one thread of the wrapper's
own: OpenMP pools belong to the thread that opens a parallel region, and a
second pool on a CPU rank makes libgomp throttle the forward's spin-wait.
Under pipeline parallelism a stage holds a call per plan in flight; they reach
that thread in the driver's order (``execute_model``'s ``seq``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import ray

from pagedserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from pagedserve.scheduler.plan_wire import EncodedPlan, PlanDecoder
from pagedserve.worker.parallel import get_node_ip_and_free_port
from pagedserve.worker.pipeline import IntermediateTensors
from pagedserve.worker.worker import Worker
from pagedserve.worker.worker_config import WorkerConfig

T = TypeVar("T")

# How long a pipelined plan waits for its predecessor to arrive: only a failed earlier
# stage (whose successors Ray never calls) leaves a gap, and the engine is dead then.
STEP_ORDER_TIMEOUT_S = 600.0


class RayWorkerWrapper:
    """Holds one Worker inside an actor process."""

    def __init__(self, config: WorkerConfig):
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-rank")
        self._turn = threading.Condition()
        self._next_seq = 0  # the next pipelined plan this rank may start
        self._wire = PlanDecoder()
        self.worker = self._on_compute_thread(Worker, config)

    def _on_compute_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return self._compute.submit(fn, *args).result()

    def get_node_ip_and_free_port(self) -> tuple[str, int]:
        """This actor's node IP and a free port (called on rank 0 before ``load_model``)."""
        return get_node_ip_and_free_port()

    def load_model(self, dist_init_method: str | None = None) -> None:
        self._on_compute_thread(self.worker.load_model, dist_init_method)

    def determine_num_blocks(self) -> int:
        return self._on_compute_thread(self.worker.determine_num_blocks)

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int | None = None) -> None:
        self._on_compute_thread(self.worker.init_kv_cache, num_gpu_blocks, num_cpu_blocks)

    def execute_model(self, plan: SchedulerOutput | EncodedPlan,
                      intermediate: IntermediateTensors | None = None,
                      seq: int | None = None
                      ) -> ModelRunnerOutput | IntermediateTensors | None:
        """Run a plan; with ``seq`` (the driver's count of plans) only after every
        earlier plan has been handed to the compute thread, so pipelined plans
        reach each rank's KV pool in the order the scheduler made them."""
        if seq is None:
            return self._on_compute_thread(self.worker.execute_model, self._plan(plan),
                                           intermediate)
        with self._turn:
            if not self._turn.wait_for(lambda: self._next_seq >= seq,
                                       timeout=STEP_ORDER_TIMEOUT_S):
                raise RuntimeError(f"step {seq} waited {STEP_ORDER_TIMEOUT_S:.0f} s for step "
                                   f"{self._next_seq}, which never came (an earlier stage failed)")
            try:  # a plan that does not decode fails its step, not the ones after it
                job = self._compute.submit(self.worker.execute_model, self._plan(plan),
                                           intermediate)
            finally:
                self._next_seq = max(self._next_seq, seq + 1)
                self._turn.notify_all()
        return job.result()

    def _plan(self, plan: SchedulerOutput | EncodedPlan) -> SchedulerOutput:
        """The whole plan: an encoded one is decoded here, in plan order (under
        ``_turn``), against what this rank's earlier plans held."""
        return self._wire.decode(plan) if isinstance(plan, EncodedPlan) else plan

    def read_kv_blocks(self, block_ids: list[int]) -> tuple[Any, ...]:
        return self._on_compute_thread(self.worker.read_kv_blocks, block_ids)

    def write_kv_blocks(self, block_ids: list[int], keys: Any, values: Any,
                        *draft: Any) -> None:
        self._on_compute_thread(self.worker.write_kv_blocks, block_ids, keys, values, *draft)

    def sleep(self, level: int) -> None:
        self._on_compute_thread(self.worker.sleep, level)

    def wake_up(self) -> None:
        self._on_compute_thread(self.worker.wake_up)

    def update_weights(self, model: str) -> None:
        self._on_compute_thread(self.worker.update_weights, model)

    def add_lora(self, lora_id: int, path: str) -> None:
        self._on_compute_thread(self.worker.add_lora, lora_id, path)

    def remove_lora(self, lora_id: int) -> bool:
        return self._on_compute_thread(self.worker.remove_lora, lora_id)

    def check_health(self) -> dict[str, Any]:
        return self.worker.check_health()

    def get_model_info(self) -> dict[str, Any]:
        return self.worker.get_model_info()

    def shutdown(self) -> None:
        """Runs on the calling thread, so it never waits behind a forward stuck on a dead peer."""
        self.worker.shutdown()

    def ping(self) -> str:
        return "pong"


RayWorker = ray.remote(RayWorkerWrapper)

__all__ = ["RayWorker", "RayWorkerWrapper", "get_node_ip_and_free_port"]
