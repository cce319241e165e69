"""``pagedserve run-batch``: a file of OpenAI batch requests through the app (vLLM's
``run-batch``).

Each input line is one request of OpenAI's Batch API, ``{"custom_id", "method":
"POST", "url", "body"}``; each output line, in input order, its answer
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``.
Why through a local deployment rather than the offline ``LLM``: a batch line
then gets exactly what the same body gets over HTTP (chat templates, tools,
structured outputs, logprobs, embeddings, adapters, errors), on as many replicas
and tensor-parallel ranks as the flags ask for. An HTTP error is an answer too
(its status and OpenAI error body, as OpenAI's batches report them); ``error`` is
set only for a line that is no request (bad JSON, no ``custom_id``, another
method or URL, ``stream``). A 503 (the replicas' queues full) is retried. Lines
are read as places in flight free up and answers written (and flushed) as soon as
every line before them is answered, so a large file is never held whole and a
killed batch keeps the answers it had.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
        "/v1/score", "/v1/rerank", "/score", "/rerank", "/v2/rerank", "/v1/classify",
        "/classify", "/pooling", "/v1/pooling")
RETRY_503 = 60  # attempts, RETRY_WAIT_S apart: a full queue drains meanwhile
RETRY_WAIT_S = 1.0


def parse_line(line: str) -> tuple[str | None, str, dict[str, Any]] | dict[str, Any]:
    """``(custom_id, url, body)``, or the output line's ``error`` when it is no request."""
    try:
        req = json.loads(line)
    except ValueError as e:
        return {"code": "invalid_json", "message": f"line is not JSON: {e}"}
    if not isinstance(req, dict):
        return {"code": "invalid_request", "message": "a line must be a JSON object"}
    cid = req.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return {"code": "missing_custom_id", "message": "custom_id must be a non-empty string"}
    if req.get("method", "POST") != "POST":
        return {"code": "invalid_method", "message": "method must be POST"}
    url, body = req.get("url"), req.get("body")
    if url not in URLS:
        return {"code": "invalid_url", "message": f"url must be one of {', '.join(URLS)}"}
    if not isinstance(body, dict):
        return {"code": "invalid_body", "message": "body must be a JSON object"}
    if body.get("stream"):
        return {"code": "invalid_body", "message": "stream is not supported in a batch"}
    return cid, url, body


def _output(cid: str | None, response: dict[str, Any] | None,
            error: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": cid, "response": response,
            "error": error}


async def _send(client: Any, base: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    for _ in range(RETRY_503):
        r = await client.post(base + url, json=body)
        if r.status_code != 503:
            break
        await asyncio.sleep(RETRY_WAIT_S)
    try:
        payload = r.json()
    except ValueError:
        payload = {"error": {"message": r.text, "type": "server_error", "param": None,
                             "code": r.status_code}}
    return {"status_code": r.status_code,
            "request_id": r.headers.get("x-request-id") or f"req_{uuid.uuid4().hex}",
            "body": payload}


async def run_lines(base: str, lines: Iterable[str], concurrency: int,
                    sink: Callable[[dict[str, Any]], None], api_key: str | None = None,
                    transport: Any = None) -> dict[str, int]:
    """Send every line (at most ``concurrency`` requests in flight, lines read as places
    free up) and give ``sink`` each output in input order as soon as all before it are
    out; returns the counts."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    ready: dict[int, dict[str, Any]] = {}
    counts = {"lines": 0, "ok": 0}

    def emit(k: int, out: dict[str, Any]) -> None:
        ready[k] = out
        while counts["lines"] in ready:
            done = ready.pop(counts["lines"])
            counts["lines"] += 1
            counts["ok"] += bool(done["response"] and done["response"]["status_code"] == 200)
            sink(done)

    async def one(client: Any, k: int, line: str) -> None:
        try:
            parsed = parse_line(line)
            if isinstance(parsed, dict):
                emit(k, _output(_custom_id(line), None, parsed))
                return
            cid, url, body = parsed
            try:
                emit(k, _output(cid, await _send(client, base, url, body), None))
            except Exception as e:  # a lost connection is this line's error, not the batch's
                emit(k, _output(cid, None, {"code": "request_failed", "message": str(e)}))
        finally:
            gate.release()

    limits = httpx.Limits(max_connections=concurrency)
    running: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(headers=headers, timeout=None, limits=limits,
                                 transport=transport) as client:
        for k, line in enumerate(lines):
            await gate.acquire()
            task = asyncio.ensure_future(one(client, k, line))
            running.add(task)
            task.add_done_callback(running.discard)
        await asyncio.gather(*running)
    return counts


def _custom_id(line: str) -> str | None:
    """A line's ``custom_id`` when it has a usable one (for a line that is no request)."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) else None


def _lines(f: TextIO) -> Iterator[str]:
    for line in f:
        if line.strip():
            yield line


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[TextIO]:
    """Whatever Ray prints while the app runs goes to stderr (file descriptor 1 too):
    stdout may be the output file, which is yielded."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real = os.fdopen(os.dup(saved), "w", encoding="utf-8")
    try:
        yield real
    finally:
        real.close()
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_batch(args: Any) -> int:
    """Deploy the app locally, send every line, write the answers, remove the app."""
    from pagedserve.cluster.local_app import SetupError, local_app

    if args.max_concurrency < 1:
        print("pagedserve run-batch: --max-concurrency must be >= 1", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            src = sys.stdin if args.input_file == "-" else stack.enter_context(
                Path(args.input_file).open(encoding="utf-8"))
            real_stdout = stack.enter_context(_stdout_to_stderr())
            dst = real_stdout if args.output_file == "-" else stack.enter_context(
                Path(args.output_file).open("w", encoding="utf-8"))

            def sink(out: dict[str, Any]) -> None:
                dst.write(json.dumps(out, separators=(",", ":")) + "\n")
                dst.flush()  # a killed batch keeps the answers before it

            base, _ = stack.enter_context(local_app(args, "run-batch", quiet=True))
            api_key = args.api_key or os.environ.get("PAGEDSERVE_API_KEY") or None
            counts = asyncio.run(run_lines(base, _lines(src), args.max_concurrency, sink,
                                           api_key))
    except OSError as e:
        print(f"pagedserve run-batch: {e}", file=sys.stderr)
        return 2
    except SetupError as e:
        print(f"pagedserve run-batch: {e}", file=sys.stderr)
        return 2
    n, ok = counts["lines"], counts["ok"]
    print(f"pagedserve run-batch: {n} lines, {ok} answered 200, {n - ok} not, "
          f"in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return 0
