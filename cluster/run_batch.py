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
method or URL, ``stream``). A 503 (the replicas' queues full) is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
        "/v1/score", "/v1/rerank", "/score", "/rerank", "/v2/rerank")
RETRY_503 = 60  # attempts, a second apart: a full queue drains meanwhile


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
        await asyncio.sleep(1.0)
    try:
        payload = r.json()
    except ValueError:
        payload = {"error": {"message": r.text, "type": "server_error", "param": None,
                             "code": r.status_code}}
    return {"status_code": r.status_code,
            "request_id": r.headers.get("x-request-id") or f"req_{uuid.uuid4().hex}",
            "body": payload}


async def run_lines(base: str, lines: list[str], concurrency: int,
                    api_key: str | None = None) -> list[dict[str, Any]]:
    """Every line's output, at most ``concurrency`` requests in flight."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def one(client: Any, line: str) -> dict[str, Any]:
        parsed = parse_line(line)
        if isinstance(parsed, dict):
            cid = None
            try:
                obj = json.loads(line)
                cid = obj.get("custom_id") if isinstance(obj, dict) else None
            except ValueError:
                pass
            return _output(cid if isinstance(cid, str) else None, None, parsed)
        cid, url, body = parsed
        async with gate:
            try:
                return _output(cid, await _send(client, base, url, body), None)
            except Exception as e:  # a lost connection is this line's error, not the batch's
                return _output(cid, None, {"code": "request_failed", "message": str(e)})

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=None, limits=limits) as client:
        return list(await asyncio.gather(*(one(client, line) for line in lines)))


def _read(path: str) -> list[str]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def _write(path: str, outputs: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(o, separators=(",", ":")) + "\n" for o in outputs)
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        Path(path).write_text(text, encoding="utf-8")


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Whatever Ray prints while the app runs goes to stderr (file descriptor 1 too):
    stdout may be the output file."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_batch(args: Any) -> int:
    """Deploy the app locally, send every line, write the answers, remove the app."""
    from pagedserve.cluster.local_app import SetupError, local_app

    if args.max_concurrency < 1:
        print("pagedserve run-batch: --max-concurrency must be >= 1", file=sys.stderr)
        return 2
    try:
        lines = _read(args.input_file)
    except OSError as e:
        print(f"pagedserve run-batch: cannot read {args.input_file}: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        with _stdout_to_stderr(), local_app(args, "run-batch", quiet=True) as (base, _):
            api_key = args.api_key or os.environ.get("PAGEDSERVE_API_KEY") or None
            outputs = asyncio.run(run_lines(base, lines, args.max_concurrency, api_key))
    except SetupError as e:
        print(f"pagedserve run-batch: {e}", file=sys.stderr)
        return 2
    _write(args.output_file, outputs)
    ok = sum(1 for o in outputs if o["response"] and o["response"]["status_code"] == 200)
    print(f"pagedserve run-batch: {len(outputs)} lines, {ok} answered 200, "
          f"{len(outputs) - ok} not, in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return 0
