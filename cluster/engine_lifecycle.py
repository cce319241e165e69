"""What is done to an idle engine: the fp8 calibration step at start-up, sleep, wake and
new weights (vLLM's sleep mode and SGLang's ``update_weights_from_disk``, for RLHF loops
that share devices with the engine and sync weights into it).

Each of sleep / wake / update is a ``Transition``: ``start_*`` checks and marks the
engine on its scheduler thread and returns the work (every rank, on the step thread in
``AsyncEngine``) and the ending that records whether it succeeded. While any of them
runs, or while asleep, new requests are refused with ``EngineSleepingError`` (a
``RuntimeError``: Serve replicas answer 503 and the ingress tries another replica).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.cluster.engine import LLMEngine

# What sets the fp8 KV scales at start-up: prose, code, numbers and markup, so keys and
# values see the kinds of tokens requests bring.
KV_CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; "
    "Neil Armstrong said: \"That's one small step for man, one giant leap for mankind.\"\n"
    "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n\n"
    "| city | population |\n|---|---|\n| Paris | 2,102,650 |\n| Tokyo | 13,960,000 |\n"
    "<html><body><p>Hello, world!</p></body></html> SELECT name FROM users WHERE id = 42; "
    "E = mc^2, 3.14159, 0x1F, -273.15 C. Bonjour, comment allez-vous? Wie geht es dir? "
    "User: What is the capital of France?\nAssistant: The capital of France is Paris."
)



class EngineSleepingError(RuntimeError):
    """The engine is asleep or loading weights; ``wake_up`` (or waiting) fixes it."""


def calibrate_kv_scales(engine: LLMEngine) -> None:
    """Embed a fixed text as the very first step, which sets the fp8 KV scales: the
    same on every replica, and not taken from whatever request (a health probe of a
    few tokens) happens to come first."""
    sched = engine.scheduler
    per_table = sched.kv.pool.num_blocks // len(sched.kv.group_windows)
    cap = min(engine.max_model_len, per_table * sched.block_size,
              sched.config.max_num_batched_tokens)  # one step, whatever the settings
    ids = engine.tokenize(KV_CALIBRATION_TEXT)[:cap]
    engine.add_request(ids, SamplingParams(max_tokens=1), "__kv_calibration__",
                     pooling_params=PoolingParams())
    while engine.has_unfinished_requests():
        engine.step()


def collect_aborted_plans(engine: LLMEngine) -> None:
    """With no request left, apply the plans still crossing the pipeline stages (an
    interrupted ``LLM.generate`` aborted their requests), so that a synchronous sleep or
    weight update finds the engine idle instead of refusing. The async engine's loop
    collects them itself (``AsyncEngine._settle`` waits for it)."""
    while (engine.pipeline and not engine._groups
           and not engine.scheduler.has_unfinished_requests()):
        plan, output, _ = engine.collect_oldest()
        engine.process(plan, output)


def _check_idle(engine: LLMEngine, what: str) -> None:
    if engine.has_unfinished_requests():
        in_flight = (f" and {len(engine.pipeline)} plans still in flight"
                     if engine.pipeline else "")
        raise ValueError(f"{what} needs an idle engine: {len(engine._groups)} requests are "
                         f"unfinished{in_flight} (wait for them or abort them)")
    if engine.unavailable is not None and not engine.sleep_level:
        raise ValueError(f"{what} while the engine is {engine.unavailable}")


Transition = tuple[Callable[[], None], Callable[[bool], None]]


def start_sleep(engine: LLMEngine, level: int) -> Transition:
    """Refuse new requests and forget the prefix cache (its blocks' contents go); the
    work frees every rank's KV shard (level 2: the weights too)."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level}")
    if engine.sleep_level:
        raise ValueError(f"the engine is already asleep (level {engine.sleep_level})")
    _check_idle(engine, "sleep")
    engine.unavailable = f"asleep (level {level}): call wake_up() first"
    engine.reset_prefix_cache()

    def end(ok: bool) -> None:
        engine.sleep_level = level if ok else 0
        if not ok:
            engine.unavailable = None

    return (lambda: engine.executor.sleep(level)), end


def start_wake(engine: LLMEngine) -> Transition:
    """The work brings weights and KV shards back, and the adapters if the model was
    rebuilt (level 2, or new weights while asleep)."""
    if not engine.sleep_level:
        raise ValueError("the engine is not asleep")
    asleep_as = engine.unavailable
    engine.unavailable = "waking up"
    reload = engine.sleep_level == 2 or engine.weights_changed

    def work() -> None:
        engine.executor.wake_up()
        if reload:
            reload_adapters(engine)

    def end(ok: bool) -> None:
        if ok:
            engine.sleep_level, engine.unavailable, engine.weights_changed = 0, None, False
        else:
            engine.unavailable = asleep_as

    return work, end


def start_update(engine: LLMEngine, model: str) -> Transition:
    """Refuse new requests while every rank loads ``model``; afterwards no cached prefix
    is valid. Asleep, the adapters go back on at wake; awake, right after the load."""
    _check_idle(engine, "update_weights")
    before, asleep = engine.unavailable, bool(engine.sleep_level)
    engine.unavailable = "loading new weights"

    def work() -> None:
        engine.executor.update_weights(model)
        if not asleep:
            reload_adapters(engine)

    def end(ok: bool) -> None:
        engine.unavailable = before
        if ok:
            engine.weights_changed = engine.weights_changed or asleep
            engine.reset_prefix_cache()
            engine.model_info = engine.executor.model_info()

    return work, end


def run_now(transition: Transition) -> None:
    """Run a transition's work on this thread (``LLMEngine``'s synchronous calls)."""
    work, end = transition
    ok = False
    try:
        work()
        ok = True
    finally:
        end(ok)


def reload_adapters(engine: LLMEngine) -> None:
    """A rebuilt model has no LoRA adapters: load every registered one again."""
    for lora in engine.loras.list():
        engine.executor.add_lora(lora.lora_int_id, lora.lora_path)
