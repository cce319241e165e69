"""The ``pagedserve`` command as a user runs it: a real process, a real local Ray."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagedserve.cluster import http_front
from tests.serving.conftest import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CLI = [sys.executable, "-m", "pagedserve.cluster.cli"]


def _env() -> dict[str, str]:
    # Serve's own control loop period (0.1 s), not the 1 s a local cluster gets to spare
    # the cores: each server here starts and stops ~6 s sooner.
    env = dict(os.environ, RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1",
               RAY_SERVE_CONTROL_LOOP_INTERVAL_S="0.1")
    env.pop("RAY_ADDRESS", None)
    return env


def test_run_batch_answers_each_line_as_the_http_api_does(tiny_model: Path,
                                                          tmp_path: Path) -> None:
    """vLLM's run-batch: a completion equals the offline engine's greedy text, a chat
    and an embedding answer 200, a bad body is its 400, lines that are no request get
    ``error``; outputs in input order, and the app, Serve and Ray are gone after."""
    from pagedserve.cluster import LLM, SamplingParams

    lines = [
        {"custom_id": "c1", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Hello world", "max_tokens": 8, "temperature": 0}},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "hi", "max_tokens": -1}},
        {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": "hello"}},
        {"custom_id": "s", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "hi", "stream": True}},
        {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([*(json.dumps(x) for x in lines), "not json"]) + "\n")
    out = subprocess.run([*CLI, "run-batch", "-i", str(src), "-o", "-", "--model",
                          str(tiny_model), "--num-gpu-blocks", "64", "--max-model-len", "512",
                          "--max-concurrency", "3", "--graceful-shutdown-wait-loop-s", "0.2"],
                         capture_output=True, text=True, timeout=300, env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    got = [json.loads(x) for x in out.stdout.splitlines()]
    assert [g["custom_id"] for g in got] == [x["custom_id"] for x in lines] + [None]
    status = [g["response"]["status_code"] if g["response"] else None for g in got]
    assert status == [200, 200, 400, 200, None, None, None]
    assert [g["error"]["code"] if g["error"] else None for g in got] == \
        [None] * 4 + ["invalid_body", "invalid_method", "invalid_json"]
    assert got[2]["response"]["body"]["error"]["param"] == "max_tokens"
    assert len(got[3]["response"]["body"]["data"][0]["embedding"]) == 64
    llm = LLM(model=str(tiny_model), num_gpu_blocks=32)
    try:
        (ref,) = llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=8))
    finally:
        llm.shutdown()
    assert got[0]["response"]["body"]["choices"][0]["text"] == ref.outputs[0].text
    assert "7 lines, 3 answered 200" in out.stderr


def test_serve_flags_reach_the_serve_args() -> None:
    from pagedserve.cluster.cli import build_parser
    from pagedserve.cluster.serve_args import ServeArgs

    ns = build_parser().parse_args([
        "serve", "--lora-modules", "a=/x", "b=/y", "--lora-dir", "/adapters", "--max-loras",
        "2", "--max-lora-rank", "8", "--max-loaded-loras", "4", "--scheduling-policy",
        "priority", "--autoscaling-config", '{"min_replicas": 1, "max_replicas": 3}',
        "--kv-cache-dtype", "fp8_e5m2", "--kv-offloading-size", "1.5", "--no-resume-streams",
        "--checkpoint-interval-ms", "250", "--drain-timeout-s", "30", "--batch-invariant",
        "--failover-wait-s", "240", "--priority-aging-s", "30",
        "--graceful-shutdown-wait-loop-s", "0.5"])
    a = ServeArgs.parse(ns)
    assert (a.lora_modules, a.lora_dir, a.max_loras, a.max_lora_rank, a.max_loaded_loras,
            a.scheduling_policy, a.autoscaling_config, a.kv_cache_dtype,
            a.kv_offloading_size, a.resume_streams, a.checkpoint_interval_ms,
            a.drain_timeout_s, a.batch_invariant, a.failover_wait_s, a.priority_aging_s,
            a.graceful_shutdown_wait_loop_s) == (
        ["a=/x", "b=/y"], "/adapters", 2, 8, 4, "priority",
        {"min_replicas": 1, "max_replicas": 3}, "fp8_e5m2", 1.5, False, 250.0, 30.0, True,
        240.0, 30.0, 0.5)
    plain = ServeArgs.parse(build_parser().parse_args([
        "serve", "--batch-invariant", "--scheduling-policy", "priority",
        "--priority-aging-s", "30", "--long-prefill-token-threshold", "256",
        "--allow-runtime-lora-updating", "-ep", "--expert-placement-strategy",
        "round_robin", "--mm-processor-kwargs", '{"do_pan_and_scan": true}',
        "--hf-overrides", '{"classifier_from_token": ["no", "yes"]}',
        "--mamba-cache-mode", "align"]))
    kwargs = plain.settings().engine_kwargs
    assert kwargs["mamba_cache_mode"] == "align"
    assert kwargs["mm_processor_kwargs"] == {"do_pan_and_scan": True}
    assert kwargs["hf_overrides"] == {"classifier_from_token": ["no", "yes"]}
    assert kwargs["batch_invariant"] is True and kwargs["priority_aging_s"] == 30.0
    assert kwargs["enable_expert_parallel"] is True
    assert kwargs["expert_placement_strategy"] == "round_robin"
    assert kwargs["long_prefill_token_threshold"] == 256
    assert plain.allow_runtime_lora_updating and kwargs["enable_lora"] is True
    with pytest.raises(ValueError, match="priority_aging_s needs scheduling_policy"):
        ServeArgs.parse(build_parser().parse_args(["serve", "--priority-aging-s", "30"])
                        ).settings()
    default = ServeArgs.parse(build_parser().parse_args(["serve"]))
    assert (default.resume_streams, default.checkpoint_interval_ms, default.drain_timeout_s,
            default.batch_invariant, default.failover_wait_s,
            default.graceful_shutdown_wait_loop_s) == (True, 1000.0, 600.0, False, 60.0, 2.0)


def test_serve_rejects_bad_settings_before_starting_anything() -> None:
    """The real process: exit code 2, the field named, no traceback (the other cases
    run in process below: a subprocess spends ~3 s importing torch and Ray each)."""
    out = subprocess.run([*CLI, "serve", "--kv-cache-dtype", "int4"], capture_output=True,
                         text=True, timeout=300, env=_env())
    assert out.returncode == 2 and "kv_cache_dtype" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(("flags", "field"), [
    (["--batch-invariant", "--device", "cuda"], "batch_invariant"),
    (["--priority-aging-s", "5"], "priority_aging_s"),
    (["--failover-wait-s", "0"], "failover_wait_s"),
    (["-ep", "--expert-placement-strategy", "packed"], "expert-placement-strategy"),
])
def test_serve_rejects_bad_settings_in_process(flags: list[str], field: str,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import ray

    from pagedserve.cluster import cli

    def no_cluster(*a: object, **kw: object) -> None:
        raise AssertionError(f"a cluster was started despite {flags}")

    monkeypatch.setattr(ray, "init", no_cluster)
    try:
        code = cli.main(["serve", *flags])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2 and field in capsys.readouterr().err


def _start_serve(tiny_model: Path, port: int, *extra: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [*CLI, "serve", "--model", str(tiny_model), "--port", str(port), "--num-gpu-blocks",
         "32", "--max-model-len", "256", "--num-threads", "1",
         "--graceful-shutdown-wait-loop-s", "0.2", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:  # always drain, so a full pipe never blocks the server
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    proc.lines = lines  # type: ignore[attr-defined]
    return proc


def _printed_urls(proc: subprocess.Popen[str], kinds: tuple[str, ...]) -> dict[str, str]:
    """The URLs the server prints (``serving``, ``direct ingress``), read until all are seen."""
    deadline, urls, seen = time.monotonic() + 240, {}, []
    while len(urls) < len(kinds):
        left = deadline - time.monotonic()
        assert left > 0 and proc.poll() is None, (urls, "".join(seen[-30:]))
        try:
            line = proc.lines.get(timeout=min(left, 1.0))  # type: ignore[attr-defined]
        except queue.Empty:
            continue
        seen.append(line)
        for kind in kinds:
            if line.startswith(f"pagedserve: {kind} "):
                urls[kind] = line.split(" at ", 1)[1].split(" ", 1)[0].strip()
        if line.startswith("pagedserve: serving ") and "; front: " in line:
            proc.front = line.rsplit("; front: ", 1)[1].rstrip(")\n")  # type: ignore[attr-defined]
    return urls


def _terminates(proc: subprocess.Popen[str], url: str, sent: bool = False) -> None:
    """SIGTERM (unless ``sent`` already) ends the server cleanly, and ``url`` no longer
    answers."""
    if not sent:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(url, timeout=5)


def _stop(proc: subprocess.Popen[str]) -> None:
    """After a failure too: SIGTERM first, so the server takes down what it started
    (HAProxy outlives a killed Ray), then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


@pytest.mark.parametrize("ingress", ["direct", "default"])
def test_serve_answers_on_its_fronts_cancels_and_drains_on_sigterm(tiny_model: Path,
                                                                   ingress: str) -> None:
    """``--ingress direct``: the proxy and the replica's own port; the default front
    (HAProxy, which ray[serve] bundles on Linux) on ``--port`` in place of the proxy. The
    flags reach the replica (API key, fp8 KV cache); a client leaving mid-stream aborts
    its request; SIGTERM closes every port, and behind the default front a stream open
    at SIGTERM finishes first (the drain), every token of it. One server per front: a
    local Ray and Serve start take most of this test's time."""
    port = free_port()
    flags = ["--ingress", "direct"] if ingress == "direct" else []
    proc = _start_serve(tiny_model, port, "--api-key", "k3y", "--kv-cache-dtype", "fp8",
                        "--max-model-len", "4096", "--num-gpu-blocks", "512", *flags)
    auth = {"Authorization": "Bearer k3y"}
    try:
        kinds = ("serving", "direct ingress") if ingress == "direct" else ("serving",)
        urls = _printed_urls(proc, kinds)
        front = urls["serving"]
        assert front == f"http://127.0.0.1:{port}/v1", urls
        others = [urls["direct ingress"]] if ingress == "direct" else []
        assert others != [front]
        if ingress == "default":
            assert proc.front == http_front.resolve_ingress("auto")  # type: ignore[attr-defined]

        def client(base: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=base, api_key="k3y", max_retries=0, timeout=120)

        def greedy(base: str, **kw: object) -> str:
            r = client(base).completions.create(model="tiny-llama",
                                                prompt="The capital of France is",
                                                max_tokens=8, temperature=0, **kw)
            if kw.get("stream"):
                return "".join(c.choices[0].text for c in r if c.choices)
            return r.choices[0].text

        answers = {greedy(u, stream=st) for u in (front, *others) for st in (False, True)}
        assert len(answers) == 1, answers
        stats = httpx.get(f"{front}/stats", headers=auth, timeout=60).json()
        assert [r["stats"]["memory"]["kv_cache_dtype"] for r in stats["replicas"]] == [
            "fp8_e4m3"]
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=60).status_code == 200

        # A client that goes away mid-stream aborts its request: on the replica's port,
        # and through HAProxy, which must pass the hang-up on to the replica.
        cancel_at = (*others, front)[0]
        with httpx.stream("POST", f"{cancel_at}/completions", timeout=120, headers=auth, json={
                "prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            for k, _ in enumerate(r.iter_lines()):
                if k == 3:
                    break

        def at_baseline() -> bool:
            (rep,) = httpx.get(f"{front}/stats", headers=auth, timeout=30).json()["replicas"]
            s = rep["stats"]
            return (s["server"]["in_flight"] == 0 and s["memory"]["num_used_blocks"] == 0
                    and s["server"]["finished"].get("abort") == 1)

        deadline = time.monotonic() + 30
        while not at_baseline():
            assert time.monotonic() < deadline, "the disconnected stream was not aborted"
            time.sleep(0.2)
        if ingress == "default":
            stream = client(front).completions.create(
                model="tiny-llama", prompt="Count:", max_tokens=1500, stream=True,
                extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
            first = next(stream)  # open: the ~4 s of decoding left run into the shutdown
            proc.send_signal(signal.SIGTERM)
            usage = [ev.usage for ev in stream if ev.usage is not None]
            assert first.choices and usage and usage[0].completion_tokens == 1500
        _terminates(proc, f"{front}/models", sent=ingress == "default")
        for url in others:
            with pytest.raises(httpx.TransportError):
                httpx.get(f"{url}/models", timeout=5)
    finally:
        _stop(proc)


def test_the_serve_loops_signal_handlers_take_no_lock() -> None:
    """``pagedserve serve`` waits for Ctrl-C / SIGTERM. Its handler used to call
    ``threading.Event.set``: a second signal landing while the first handler held the
    event's lock (Ctrl-C twice, or a supervisor signalling both a wrapper that forwards
    it and the server) ran the handler again inside it, which waited for that lock
    forever; the server hung (seen here under ``timeout``). The handlers now only note
    the signal: no call they make takes a lock, and nested they still stop the loop."""
    from pagedserve.cluster.cli import install_stop_handlers, wait_for_stop

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = install_stop_handlers()
        handler = signal.getsignal(signal.SIGTERM)
        calls: list[str] = []

        def profile(frame, event, arg) -> None:
            if event == "call":
                calls.append(frame.f_code.co_qualname)
            elif event == "c_call":
                calls.append(getattr(arg, "__qualname__", str(arg)))

        sys.setprofile(profile)
        try:
            handler(signal.SIGTERM, None)
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # as if nested
        finally:
            sys.setprofile(None)
        assert stop == [signal.SIGTERM, signal.SIGINT]
        assert not [c for c in calls if any(w in c for w in ("acquire", "__enter__", "Event",
                                                             "Condition", "Lock"))], calls
        assert wait_for_stop(stop) == signal.SIGTERM
        for round_ in range(10):  # real signals, in bursts, from another thread
            stop = install_stop_handlers()

            def burst(n: int, sig: signal.Signals) -> None:
                for _ in range(n):
                    os.kill(os.getpid(), sig)

            sender = threading.Thread(target=burst, args=(
                1 + round_ % 4, signal.SIGTERM if round_ % 2 else signal.SIGINT))
            t0 = time.monotonic()
            sender.start()
            assert wait_for_stop(stop, poll_s=0.01) in (signal.SIGINT, signal.SIGTERM)
            sender.join(5)
            assert time.monotonic() - t0 < 5
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
