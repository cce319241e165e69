"""How long an idle engine, woken by a request, waits for the rest of its burst.

Requests sent together do not reach an HTTP engine replica together: the
ingress takes them one at a time, about 3 ms each on the 2-core CPU box, so
32 of them arrive over 80-150 ms. An engine that starts at once runs a first
step for the one or two already there. On CPU that step takes 0.3-0.5 s, the
rest wait through it, and their prompts then take two more steps: a 32-stream
burst's prompt phase took three steps through HTTP where the in-process
engine, which sees all 32 at once, took two (step timelines of `bench/serve.py`'s
burst, logged by a probe).

``BurstPolicy`` sets the quiet gap: the engine waits until no request has
arrived for that long, at most ``GAPS_CAP`` gaps in all, and stops as soon as
the waiting prompts fill a step's token budget (more could not join that step
anyway). An explicit ``burst_wait_ms`` is the gap. ``None`` (the default) sizes
it from the step the engine would otherwise start: ``AUTO_FRACTION`` of its
estimated time (waiting prompt tokens times the seconds per token measured on
earlier steps), at most ``AUTO_MAX_GAP_S``. A lone request so pays at most
that fraction of its own first step: on the CPU box, 8 ms or so on a 128-token
prompt whose step takes 150-350 ms; on a GPU, where such a step takes a few
milliseconds, a fraction of a millisecond. Before the engine has measured a
step it does not wait. vLLM does not wait at all (its ``scheduler_delay_factor``
was off by default); there a lone request loses nothing and a burst on a slow
device loses its first step.
"""

from __future__ import annotations

GAPS_CAP = 5  # a burst is gathered for at most this many quiet gaps
AUTO_FRACTION = 0.05  # auto: the gap is this share of the estimated first step
AUTO_MAX_GAP_S = 0.02  # auto: and never longer than this
MEASURE_MIN_TOKENS = 64  # steps this large are prompt work, whose rate the estimate wants
RATE_SMOOTHING = 0.3  # weight of the newest step in the seconds-per-token average


class BurstPolicy:
    """The quiet gap an idle engine waits for, explicit or sized from measured steps."""

    def __init__(self, burst_wait_ms: float | None, step_token_budget: int) -> None:
        self.explicit_s = None if burst_wait_ms is None else burst_wait_ms / 1000.0
        self.step_token_budget = step_token_budget
        self.seconds_per_token: float | None = None

    @property
    def enabled(self) -> bool:
        return self.explicit_s is None or self.explicit_s > 0

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """Fold one forward's duration into the rate estimate (prompt-sized steps only)."""
        if num_tokens < MEASURE_MIN_TOKENS or seconds <= 0:
            return
        rate = seconds / num_tokens
        old = self.seconds_per_token
        self.seconds_per_token = rate if old is None else (
            RATE_SMOOTHING * rate + (1 - RATE_SMOOTHING) * old)

    def quiet_gap(self, waiting_tokens: int) -> float:
        """Seconds without a new arrival after which the engine starts; 0: start now."""
        if waiting_tokens >= self.step_token_budget:
            return 0.0
        if self.explicit_s is not None:
            return self.explicit_s
        if self.seconds_per_token is None:
            return 0.0
        return min(AUTO_MAX_GAP_S, AUTO_FRACTION * waiting_tokens * self.seconds_per_token)
