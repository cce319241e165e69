"""Request ids: what names a response, and what names its requests in the engine.

vLLM's rule: a response (completion, chat, embeddings, score, rerank) is
``<prefix>-<id>`` where ``<id>`` is the body's ``request_id``, else the
``X-Request-Id`` header, else a fresh one; the engine's own id adds a random
suffix so that ids stay unique while a client reuses one.
"""

from __future__ import annotations

import uuid

from pagedserve.cluster.protocol import APIError

MAX_REQUEST_ID_CHARS = 256


def request_ids(prefix: str, given: str | None, header: str | None) -> tuple[str, str]:
    """``(response id, engine id)`` of one response. As in vLLM, the body's
    ``request_id`` or else the ``X-Request-Id`` header names the response
    (``prefix-<id>``); Serve's front sets that header on every request that lacks one
    and echoes it back, so the client, Serve's logs and the engine's agree on it. The
    engine id adds a random suffix: a client may reuse an id while an earlier request
    still runs. A body ``request_id`` that is empty, too long or not printable is a 400;
    such a header is replaced by a fresh id."""
    def usable(v: str | None) -> bool:
        return bool(v) and len(v) <= MAX_REQUEST_ID_CHARS and v.isprintable()

    if given is not None and not usable(given):
        raise APIError(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} printable "
                       "characters", param="request_id")
    base = given if given is not None else header if usable(header) else uuid.uuid4().hex
    rid = f"{prefix}-{base}"
    return rid, f"{rid}.{uuid.uuid4().hex[:8]}"
