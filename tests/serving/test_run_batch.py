"""Batch lines that are no request, without Ray: each gets the ``error`` code naming
what is wrong; a request line gives its custom_id, URL and body."""

from __future__ import annotations

import json

import pytest

from pagedserve.cluster.run_batch import parse_line

GOOD = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": []}}


@pytest.mark.parametrize(("line", "code"), [
    ("{", "invalid_json"),
    ("[1, 2]", "invalid_request"),
    (json.dumps({**GOOD, "custom_id": ""}), "missing_custom_id"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "custom_id"}), "missing_custom_id"),
    (json.dumps({**GOOD, "method": "GET"}), "invalid_method"),
    (json.dumps({**GOOD, "url": "/v1/files"}), "invalid_url"),
    (json.dumps({**GOOD, "body": "text"}), "invalid_body"),
    (json.dumps({**GOOD, "body": {"stream": True}}), "invalid_body"),
])
def test_lines_that_are_no_request_name_why(line: str, code: str) -> None:
    got = parse_line(line)
    assert isinstance(got, dict) and got["code"] == code


def test_a_request_line() -> None:
    assert parse_line(json.dumps(GOOD)) == ("a", "/v1/chat/completions", {"messages": []})
    no_method = {k: v for k, v in GOOD.items() if k != "method"}  # POST by default
    assert parse_line(json.dumps(no_method))[1] == "/v1/chat/completions"


def test_outputs_come_in_input_order_as_soon_as_they_can(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Against a stand-in server answering in reverse order (the real app answers in
    ``test_cli``): each output is written once all before it are, never more than the
    bound in flight, 503s retried, a lost connection that line's error."""
    import asyncio

    import httpx

    import pagedserve.cluster.run_batch as rb

    state = {"open": 0, "most": 0, "busy": 2, "answered": 0}

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("busy") and state["busy"]:
            state["busy"] -= 1
            return httpx.Response(503)
        if body.get("drop"):
            raise httpx.ConnectError("gone")
        state["open"] += 1
        state["most"] = max(state["most"], state["open"])
        await asyncio.sleep(0.01 * (5 - body["k"]))  # later lines answer first
        state["open"] -= 1
        state["answered"] += 1
        return httpx.Response(200, json={"k": body["k"]})

    lines = [json.dumps({"custom_id": f"c{k}", "url": "/v1/completions",
                         "body": {"k": k, **({"busy": True} if k == 1 else {}),
                                  **({"drop": True} if k == 3 else {})}})
             for k in range(5)]
    lines.insert(2, "nonsense")
    out: list[dict] = []
    order: list[int] = []
    monkeypatch.setattr(rb, "RETRY_WAIT_S", 0.0)

    def sink(o: dict) -> None:
        out.append(o)
        order.append(state["answered"])

    counts = asyncio.run(rb.run_lines("http://x", iter(lines), 2, sink,
                                      transport=httpx.MockTransport(handler)))
    assert [o["custom_id"] for o in out] == ["c0", "c1", None, "c2", "c3", "c4"]
    assert [o["response"]["body"]["k"] for o in out if o["response"]] == [0, 1, 2, 4]
    assert out[2]["error"]["code"] == "invalid_json"
    assert out[4]["error"]["code"] == "request_failed"
    assert state["most"] <= 2 and state["busy"] == 0
    assert counts == {"lines": 6, "ok": 4}
    assert order[0] < 4  # the first output went out before the last answers came
