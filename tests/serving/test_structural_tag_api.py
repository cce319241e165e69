"""``response_format: {"type": "structural_tag", ...}`` over HTTP (vLLM's form)."""

from __future__ import annotations

import json

import httpx

from tests.cluster.test_structural_tags import TAG
from tests.serving.conftest import App


def test_response_format_structural_tag(smol: App) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 60, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Call the tool for Paris."}]}
    r = httpx.post(f"{smol.base}/v1/chat/completions", headers=smol.headers, timeout=120,
                   json={**body, "response_format": TAG})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert text.startswith("<tool>") and text.endswith("</tool>"), text
    assert set(json.loads(text[len("<tool>"):-len("</tool>")])) == {"city"}
    bad = {"type": "structural_tag", "format": {"type": "nope"}}
    r = httpx.post(f"{smol.base}/v1/chat/completions", headers=smol.headers, timeout=120,
                   json={**body, "response_format": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
