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
