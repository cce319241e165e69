"""Mid-stream failover: a replica killed under open streams; they go on from the other.

Two replicas of a random tiny Llama. Three long streams (greedy with logprobs, seeded
sampling, and seeded sampling with ``n=2``, whose samples go on as two requests) share a
prompt long enough that the prefix-affinity router puts them on one replica, which is
killed while they stream. Each choice must still finish with exactly the text of the
same request run uninterrupted, every token once (usage and logprob counts), the
ingress counts three resumes, and once Serve has replaced the dead replica both pools
are at baseline and the router has forgotten the dead one's prefixes. A non-streamed
greedy request whose replica is killed resumes the same way from the checkpoints its
replica sent the ingress. With ``resume_streams=False`` the same kill ends the stream
with an error event instead, and the non-streamed request starts again on the other
replica. With ``batch_invariant`` the streams and the non-streamed request share the
killed replica's batches and still end with every logprob equal to their runs alone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serving.conftest import App, Cluster, at_baseline, kill_engine_replica, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPT = "Count slowly and carefully, one number after another, never stopping: " * 3
MAX_TOKENS = 700  # ~10 s of streaming here: the kill lands within the first second
REQUESTS = {
    "greedy": {"temperature": 0.0, "logprobs": 1},
    "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 1234},
    "seeded n=2": {"temperature": 1.0, "seed": 99, "n": 2},
}
WHOLE = {"temperature": 0.0, "logprobs": 1}  # the non-streamed request


@pytest.fixture(scope="module")
def pair(cluster: Cluster, tiny_model: Path) -> Iterator[App]:
    app = cluster.deploy("failover", {
        "model": str(tiny_model), "num_replicas": 2, "num_threads": 1,
        "num_gpu_blocks": 512, "max_model_len": 4096, "checkpoint_interval_ms": 50,
        "health_check_period_s": 1.0, "health_check_timeout_s": 10.0})
    yield app
    cluster.delete("failover")


def _stream(app: App, kw: dict[str, Any], out: dict[str, Any],
            started: threading.Event | None = None) -> None:
    """One completion stream's text per choice, logprobs and usage into ``out`` (or its
    error)."""
    text: dict[int, list[str]] = {}
    lps: list[float] = []
    try:
        for k, ev in enumerate(app.openai().completions.create(
                model="tiny-llama", prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                **kw)):
            if ev.usage is not None:
                out["usage"] = ev.usage
            for c in ev.choices:
                text.setdefault(c.index, []).append(c.text)
                if c.logprobs is not None:
                    lps.extend(c.logprobs.token_logprobs)
                if c.finish_reason is not None:
                    out.setdefault("finish_reasons", []).append(c.finish_reason)
            if started is not None and k >= 3:
                started.set()
    except BaseException as e:  # recorded: the test says what it expected
        out["error"] = e
    finally:
        if started is not None:
            started.set()
    out["text"] = {i: "".join(t) for i, t in sorted(text.items())}
    out["logprobs"] = lps


def _complete(app: App, out: dict[str, Any]) -> None:
    """The non-streamed request's text, logprobs and usage into ``out`` (or its error)."""
    try:
        r = app.openai().completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=MAX_TOKENS,
            extra_body={"ignore_eos": True}, **WHOLE)
        out.update(text=r.choices[0].text, logprobs=r.choices[0].logprobs.token_logprobs,
                   usage=r.usage, finish_reason=r.choices[0].finish_reason)
    except BaseException as e:  # recorded: the test says what it expected
        out["error"] = e


def _start_whole(app: App, out: dict[str, Any]) -> threading.Thread:
    """The non-streamed request, started and seen running on a replica."""
    t = threading.Thread(target=_complete, args=(app, out))
    t.start()
    wait_for(lambda: any(s["server"]["in_flight"] > 0 for s in app.stats().values()), 60,
             "the non-streamed request running")
    return t


def _replica_states(app: App) -> dict[str, dict[str, Any]] | None:
    try:
        return app.stats()
    except httpx.HTTPError:
        return None


def test_streams_of_a_killed_replica_finish_on_the_other_unchanged(pair: App) -> None:
    expected: dict[str, dict[str, Any]] = {name: {} for name in REQUESTS}
    threads = [threading.Thread(target=_stream, args=(pair, kw, expected[name]))
               for name, kw in REQUESTS.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for name, e in expected.items():
        n = REQUESTS[name].get("n", 1)
        assert "error" not in e and e["usage"].completion_tokens == n * MAX_TOKENS, e
        assert len(e["text"]) == n and len(set(e["text"].values())) == n
    pair.wait_baseline()

    got: dict[str, dict[str, Any]] = {name: {} for name in REQUESTS}
    started = {name: threading.Event() for name in REQUESTS}
    threads = [threading.Thread(target=_stream, args=(pair, kw, got[name], started[name]))
               for name, kw in REQUESTS.items()]
    for t in threads:
        t.start()
    for ev in started.values():
        assert ev.wait(60)
    busy = [rid for rid, s in pair.stats().items() if s["server"]["in_flight"] > 0]
    assert len(busy) == 1, busy  # all streams on the replica holding their prefix
    kill_engine_replica(busy[0])
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    for name in REQUESTS:
        g, e = got[name], expected[name]
        assert "error" not in g, (name, g.get("error"))
        n = REQUESTS[name].get("n", 1)
        assert g["usage"].completion_tokens == n * MAX_TOKENS, name
        assert g["finish_reasons"] == ["length"] * n, name
        assert g["text"] == e["text"], name
    assert len(got["greedy"]["logprobs"]) == MAX_TOKENS
    assert got["greedy"]["logprobs"] == pytest.approx(expected["greedy"]["logprobs"], abs=1e-3)

    metrics = httpx.get(f"{pair.base}/metrics", timeout=30).text
    assert 'pagedserve_request_failovers_total{kind="resume"} 3.0' in metrics, [
        line for line in metrics.splitlines() if "failover" in line]
    _wait_replaced(pair, busy[0])


def _wait_replaced(app: App, dead: str) -> None:
    def replaced() -> bool:
        states = _replica_states(app)
        return bool(states) and len(states) == 2 and dead not in states and all(
            at_baseline(s) for s in states.values())

    wait_for(replaced, 120, "a replacement replica and both pools at baseline")
    # The router forgot the dead replica's prefixes.
    affinity = httpx.get(f"{app.base}/v1/stats", timeout=60).json()["affinity_blocks"]
    assert dead not in affinity, affinity


def _failovers(app: App, kind: str) -> float:
    metrics = httpx.get(f"{app.base}/metrics", timeout=30).text
    prefix = f'pagedserve_request_failovers_total{{kind="{kind}"}} '
    return next(float(line[len(prefix):]) for line in metrics.splitlines()
                if line.startswith(prefix))


def test_a_non_streamed_request_of_a_killed_replica_resumes_from_its_checkpoint(
        pair: App) -> None:
    """Alone, so that it runs in the same batches (of one) as its reference: a seeded or
    near-tie draw would otherwise depend on fp32 rounding of other batch shapes."""
    whole: dict[str, Any] = {}
    _complete(pair, whole)
    assert "error" not in whole and whole["usage"].completion_tokens == MAX_TOKENS
    pair.wait_baseline()
    resumes = _failovers(pair, "resume")
    before = {rid: s["generation_tokens"] for rid, s in pair.stats().items()}

    got: dict[str, Any] = {}
    t = _start_whole(pair, got)
    busy = [rid for rid, s in pair.stats().items() if s["server"]["in_flight"] > 0]
    assert len(busy) == 1, busy
    # 200 tokens in: several of its 50 ms checkpoints have reached the ingress.
    wait_for(lambda: pair.stats()[busy[0]]["generation_tokens"] - before[busy[0]] >= 200, 60,
             "200 tokens of the non-streamed request")
    kill_engine_replica(busy[0])
    t.join(120)
    assert not t.is_alive() and "error" not in got, got.get("error")
    assert (got["text"], got["usage"].completion_tokens, got["finish_reason"]) == (
        whole["text"], MAX_TOKENS, "length")
    assert got["logprobs"] == pytest.approx(whole["logprobs"], abs=1e-3)
    # A resume (with checkpoints off in dispatch it would be a retry: the test fails).
    assert _failovers(pair, "resume") == resumes + 1
    _wait_replaced(pair, busy[0])


@pytest.fixture(scope="module")
def no_resume(cluster: Cluster, tiny_model: Path) -> Iterator[App]:
    app = cluster.deploy("noresume", {
        "model": str(tiny_model), "num_replicas": 2, "num_threads": 1,
        "num_gpu_blocks": 512, "max_model_len": 4096, "resume_streams": False,
        "health_check_period_s": 1.0, "health_check_timeout_s": 10.0})
    yield app
    cluster.delete("noresume")


def test_without_resume_streams_a_killed_replicas_stream_ends_with_an_error(
        no_resume: App) -> None:
    import openai

    out: dict[str, Any] = {}
    whole: dict[str, Any] = {}
    started = threading.Event()
    w = _start_whole(no_resume, whole)
    t = threading.Thread(target=_stream, args=(no_resume, REQUESTS["greedy"], out, started))
    t.start()
    assert started.wait(60)
    busy = [rid for rid, s in no_resume.stats().items() if s["server"]["in_flight"] > 0]
    assert len(busy) == 1, busy
    kill_engine_replica(busy[0])
    t.join(120)
    w.join(120)
    assert not t.is_alive() and not w.is_alive()
    assert isinstance(out.get("error"), openai.APIError), out.get("error")
    assert 0 < len(out["logprobs"]) < MAX_TOKENS
    # Nothing of it reached its client: the non-streamed request ran again, whole.
    assert "error" not in whole, whole.get("error")
    assert (whole["usage"].completion_tokens, whole["finish_reason"]) == (MAX_TOKENS, "length")
    metrics = httpx.get(f"{no_resume.base}/metrics", timeout=30).text
    assert 'pagedserve_request_failovers_total{kind="resume"} 0.0' in metrics
    assert 'pagedserve_request_failovers_total{kind="retry"} 1.0' in metrics


@pytest.fixture(scope="module")
def invariant_pair(cluster: Cluster, tiny_model: Path) -> Iterator[App]:
    app = cluster.deploy("invariant", {
        "model": str(tiny_model), "num_replicas": 2, "num_threads": 1,
        "num_gpu_blocks": 512, "max_model_len": 4096, "checkpoint_interval_ms": 50,
        "batch_invariant": True, "health_check_period_s": 1.0,
        "health_check_timeout_s": 10.0})
    yield app
    cluster.delete("invariant")


def test_batch_invariant_failover_is_exact_in_a_crowd(invariant_pair: App) -> None:
    """With ``batch_invariant``, requests that shared their replica's batches, moved
    mid-way to another replica and recomputed there, end with the bits each gets alone:
    texts and every logprob equal (``==``), the non-streamed request among the streams."""
    app = invariant_pair
    streams = {"greedy": REQUESTS["greedy"],
               "seeded": {**REQUESTS["seeded"], "logprobs": 1}}
    alone: dict[str, dict[str, Any]] = {name: {} for name in streams}
    for name, kw in streams.items():
        _stream(app, kw, alone[name])
    for name, out in alone.items():
        assert "error" not in out and len(out["logprobs"]) == MAX_TOKENS, name
    # The non-streamed request is the greedy stream's (one run fewer): alone, its bits
    # are the greedy stream's, so in the crowd it must end with them too.
    assert REQUESTS["greedy"] == WHOLE
    alone["whole"] = {"text": alone["greedy"]["text"][0],
                      "logprobs": alone["greedy"]["logprobs"]}
    assert all(s["batch_invariant"] for s in app.wait_baseline().values())

    got: dict[str, dict[str, Any]] = {name: {} for name in alone}
    started = {name: threading.Event() for name in streams}
    threads = [_start_whole(app, got["whole"])]  # first: it has checkpoints at the kill
    threads += [threading.Thread(target=_stream, args=(app, kw, got[name], started[name]))
                for name, kw in streams.items()]
    for t in threads[1:]:
        t.start()
    for ev in started.values():
        assert ev.wait(60)
    busy = [rid for rid, s in app.stats().items() if s["server"]["in_flight"] > 0]
    assert len(busy) == 1, busy
    kill_engine_replica(busy[0])
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    for name, want in alone.items():
        assert "error" not in got[name], (name, got[name].get("error"))
        assert got[name]["text"] == want["text"], name
        assert got[name]["logprobs"] == want["logprobs"], name
    assert _failovers(app, "resume") == 3
    _wait_replaced(app, busy[0])
