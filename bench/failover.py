"""Mid-stream failover: a stream whose replica is killed, resumed vs sent again.

Two engine replicas of the default model (SmolLM2-135M, fp32, one thread each). A
greedy chat stream of ``--max-tokens`` tokens runs; once the client holds
``--kill-after`` of them, the replica serving it is killed (``ray.kill``). Two apps,
one after the other, in one run:

- ``resume``: pagedserve's default: the ingress resumes the stream on the other replica
  from the tokens it already sent (``cluster/resume.py``); the client sees one stream.
- ``restart``: the same app with ``resume_streams=False``, i.e. a server without
  mid-stream failover: the stream ends with an error event and the client sends the
  request again, skipping the tokens it already has (greedy, so they are the same).

For each it reports the time from the kill to the first new token (the stall the user
sees), from the kill to the end of the stream, and whether the client's text equals an
uninterrupted run's; medians over ``--repeat`` kills (Serve replaces the killed replica
between them), and the ratios restart / resume.

With ``--non-streamed`` the request is a plain (non-streamed) chat completion, killed
at ``--kill-at`` of its uninterrupted latency, in two apps:

- ``resume``: the default: its replica sends the ingress a checkpoint of its tokens
  every ``checkpoint_interval_ms`` (1 s), and the ingress resumes it from the last one;
- ``restart``: ``checkpoint_interval_ms=0``: no checkpoints, so the ingress sends it
  again from the start (what it did before checkpoints; the client sees no error).

It reports the kill-to-answer time and the answer's latency over the uninterrupted
one, and, since checkpoints are messages too, what they cost a burst of
``--burst`` concurrent non-streamed requests that no kill disturbs (wall time, with
checkpoints over without; both apps are deployed at once and their bursts alternate).

    python bench/failover.py --json bench/figures/failover.json
    python bench/failover.py --non-streamed --json bench/figures/failover_whole.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time
from typing import Any

MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper who "
             "finds a message in a bottle. Describe every day of the week in detail."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stats(base: str) -> dict[str, dict[str, Any]]:
    import httpx

    r = httpx.get(f"{base}/v1/stats", timeout=60)
    r.raise_for_status()
    return {rep["replica"]: rep.get("stats") for rep in r.json()["replicas"]}


def _wait_two_idle_replicas(base: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            st = _stats(base)
        except Exception:
            st = {}
        if len(st) == 2 and all(s and s["num_running"] == 0 and s["num_waiting"] == 0
                                for s in st.values()):
            return
        time.sleep(0.5)
    raise RuntimeError("the app did not get back to two idle replicas")


class Stream:
    """One chat stream in a thread: token pieces with their arrival times."""

    def __init__(self, base: str, max_tokens: int) -> None:
        import openai

        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0,
                                    timeout=300)
        self.max_tokens = max_tokens
        self.pieces: list[tuple[float, str]] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        try:
            for ev in self.client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", messages=MESSAGES, stream=True,
                    temperature=0, max_tokens=self.max_tokens,
                    extra_body={"ignore_eos": True}):
                for c in ev.choices:
                    if c.delta.content:
                        self.pieces.append((time.perf_counter(), c.delta.content))
        except BaseException as e:  # the restart case expects this
            self.error = e
        finally:
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(p for _, p in self.pieces)


def one_kill(base: str, max_tokens: int, kill_after: int, expected: str,
             resume: bool) -> dict[str, Any]:
    """Kill the replica under a stream; with ``resume`` False, send the request again."""
    import ray

    s = Stream(base, max_tokens)
    s.thread.start()
    while len(s.pieces) < kill_after and not s.done.is_set():
        time.sleep(0.005)
    replica = _busy_replica(base)
    had = len(s.pieces)
    t_kill = time.perf_counter()
    ray.kill(replica, no_restart=True)
    s.thread.join()
    pieces, error = list(s.pieces), s.error
    if not resume:
        if error is None:
            raise RuntimeError("the stream survived the kill without resuming")
        have = "".join(p for _, p in pieces)
        again = Stream(base, max_tokens)  # what a client of such a server does
        again.thread.start()
        again.thread.join()
        if again.error is not None:
            raise again.error
        seen, new = 0, []
        for t, p in again.pieces:  # the client drops what it already has
            if seen + len(p) > len(have):
                new.append((t, p[max(0, len(have) - seen):]))
            seen += len(p)
        pieces, error = pieces + new, None
    if error is not None:
        raise error
    after = [t for t, _ in pieces[had:]]
    return {"tokens_before_kill": had,
            "stall_s": after[0] - t_kill if after else float("nan"),
            "kill_to_end_s": pieces[-1][0] - t_kill,
            "text_equal": "".join(p for _, p in pieces) == expected}


def _complete(base: str, max_tokens: int) -> tuple[str, float]:
    """A non-streamed greedy chat completion: its text and its latency."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    t0 = time.perf_counter()
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES,
                                       temperature=0, max_tokens=max_tokens,
                                       extra_body={"ignore_eos": True})
    return r.choices[0].message.content or "", time.perf_counter() - t0


def _busy_replica(base: str) -> Any:
    """The actor of the engine replica that has a request in flight."""
    import ray

    busy = [rid for rid, st in _stats(base).items() if st and st["server"]["in_flight"]]
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if busy and a["name"].endswith(f"#EngineServer#{busy[0]}")]
    return ray.get_actor(names[0], namespace="serve")


def one_kill_whole(base: str, max_tokens: int, kill_at_s: float, expected: str,
                   uninterrupted_s: float) -> dict[str, Any]:
    """Kill the replica under a non-streamed request ``kill_at_s`` after it was sent."""
    import ray

    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["text"], out["latency_s"] = _complete(base, max_tokens)
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run)
    t0 = time.perf_counter()
    t.start()
    time.sleep(kill_at_s)
    replica = _busy_replica(base)
    t_kill = time.perf_counter()
    ray.kill(replica, no_restart=True)
    t.join()
    if "error" in out:
        raise out["error"]
    return {"killed_at_s": t_kill - t0, "kill_to_answer_s": t0 + out["latency_s"] - t_kill,
            "latency_over_uninterrupted": out["latency_s"] / uninterrupted_s,
            "text_equal": out["text"] == expected}


def burst_wall_s(base: str, n: int, max_tokens: int) -> float:
    """Wall time of ``n`` concurrent non-streamed requests (no kill)."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda _: _complete(base, max_tokens), range(n)))
    return time.perf_counter() - t0


def run_whole(args: argparse.Namespace, base_url: str) -> dict[str, dict[str, Any]]:
    """Both apps deployed side by side (the idle one costs nothing): the bursts
    alternate between them, then each app's kills run in turn."""
    from ray import serve

    from pagedserve.cluster.serve_app import build_app

    modes = {"resume": 1000.0, "restart": 0.0}  # checkpoint_interval_ms
    for name, every in modes.items():
        serve.run(build_app({"num_replicas": 2, "num_threads": 1, "max_model_len": 2048,
                             "health_check_period_s": 1.0, "checkpoint_interval_ms": every}),
                  name=name, route_prefix=f"/{name}")
    bases = {name: f"{base_url}/{name}" for name in modes}
    res: dict[str, dict[str, Any]] = {name: {"burst_wall_s": []} for name in modes}
    try:
        for name, base in bases.items():
            _wait_two_idle_replicas(base)
            expected, whole_s = _complete(base, args.max_tokens)
            res[name].update(expected=expected, uninterrupted_s=whole_s)
        for _ in range(args.repeat):
            for name, base in bases.items():
                _wait_two_idle_replicas(base)
                res[name]["burst_wall_s"].append(
                    burst_wall_s(base, args.burst, args.burst_tokens))
        for name, base in bases.items():
            r, rows = res[name], []
            for i in range(args.repeat):
                _wait_two_idle_replicas(base)
                row = one_kill_whole(base, args.max_tokens, args.kill_at * r["uninterrupted_s"],
                                     r["expected"], r["uninterrupted_s"])
                rows.append(row)
                print(f"{name} #{i}: {row}", flush=True)
            r["kills"] = rows
            _wait_two_idle_replicas(base)
            del r["expected"]
        return res
    finally:
        for name in modes:
            serve.delete(name)


def run_app(name: str, resume: bool, args: argparse.Namespace, base_url: str
            ) -> list[dict[str, Any]]:
    from ray import serve

    from pagedserve.cluster.serve_app import build_app

    serve.run(build_app({"num_replicas": 2, "num_threads": 1, "max_model_len": 2048,
                         "health_check_period_s": 1.0, "resume_streams": resume}),
              name=name, route_prefix=f"/{name}")
    base = f"{base_url}/{name}"
    try:
        _wait_two_idle_replicas(base)
        whole = Stream(base, args.max_tokens)
        whole.thread.start()
        whole.thread.join()
        if whole.error is not None:
            raise whole.error
        rows = []
        for i in range(args.repeat):
            _wait_two_idle_replicas(base)
            row = one_kill(base, args.max_tokens, args.kill_after, whole.text, resume)
            rows.append(row)
            print(f"{name} #{i}: {row}", flush=True)
        return rows
    finally:
        serve.delete(name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=None,
                   help="default 256, or 512 with --non-streamed (half of it is then "
                        "worth keeping)")
    p.add_argument("--kill-after", type=int, default=128,
                   help="text pieces the client holds when the replica is killed")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--non-streamed", action="store_true",
                   help="a non-streamed request: checkpoints vs none")
    p.add_argument("--kill-at", type=float, default=0.5,
                   help="--non-streamed: kill at this share of the uninterrupted latency")
    p.add_argument("--burst", type=int, default=32,
                   help="--non-streamed: concurrent requests of the checkpoint-cost burst")
    p.add_argument("--burst-tokens", type=int, default=256)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    if args.max_tokens is None:
        args.max_tokens = 512 if args.non_streamed else 256
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=16)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    try:
        if args.non_streamed:
            whole = run_whole(args, url)
        else:
            res = {"resume": run_app("resume", True, args, url),
                   "restart": run_app("restart", False, args, url)}
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.non_streamed:
        summarise_whole(args, whole)
        return
    summary: dict[str, Any] = {"args": vars(args), "runs": res}
    print(f"\n{'mode':<8} {'stall s':>8} {'kill->end s':>12} {'text equal':>11}")
    for mode, rows in res.items():
        stall = statistics.median(r["stall_s"] for r in rows)
        end = statistics.median(r["kill_to_end_s"] for r in rows)
        equal = all(r["text_equal"] for r in rows)
        summary[mode] = {"median_stall_s": stall, "median_kill_to_end_s": end,
                         "all_text_equal": equal}
        print(f"{mode:<8} {stall:>8.3f} {end:>12.3f} {equal!s:>11}")
    for key in ("median_stall_s", "median_kill_to_end_s"):
        ratio = summary["restart"][key] / summary["resume"][key]
        summary[f"restart_over_resume_{key[7:]}"] = ratio
        print(f"restart / resume, {key[7:]}: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


def summarise_whole(args: argparse.Namespace, res: dict[str, dict[str, Any]]) -> None:
    summary: dict[str, Any] = {"args": vars(args), "runs": res}
    print(f"\n{'mode':<8} {'uninterrupted s':>16} {'kill->answer s':>15} "
          f"{'latency / uninterrupted':>24} {'text equal':>11} {'burst s':>8}")
    for mode, r in res.items():
        rows = r["kills"]
        med = {"median_kill_to_answer_s": statistics.median(x["kill_to_answer_s"] for x in rows),
               "median_latency_over_uninterrupted": statistics.median(
                   x["latency_over_uninterrupted"] for x in rows),
               "all_text_equal": all(x["text_equal"] for x in rows),
               "median_burst_wall_s": statistics.median(r["burst_wall_s"])}
        summary[mode] = med
        print(f"{mode:<8} {r['uninterrupted_s']:>16.2f} {med['median_kill_to_answer_s']:>15.2f} "
              f"{med['median_latency_over_uninterrupted']:>24.2f} "
              f"{med['all_text_equal']!s:>11} {med['median_burst_wall_s']:>8.2f}")
    ratio = (summary["restart"]["median_kill_to_answer_s"]
             / summary["resume"]["median_kill_to_answer_s"])
    cost = summary["resume"]["median_burst_wall_s"] / summary["restart"]["median_burst_wall_s"]
    summary["restart_over_resume_kill_to_answer"] = ratio
    summary["checkpoint_cost_burst"] = cost
    print(f"restart / resume, kill->answer: {ratio:.2f}x")
    print(f"checkpoints' cost, burst of {args.burst} x {args.burst_tokens} tokens "
          f"(with / without): {cost:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
