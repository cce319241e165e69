"""Every error the ingress answers is in OpenAI's shape, unknown routes and methods
included (FastAPI alone answers those ``{"detail": ...}``); no Ray needed."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from pydantic import BaseModel

from pagedserve.cluster.http_errors import api_error, validation_error
from pagedserve.cluster.protocol import APIError


def _is_openai_error(body: dict, code: int) -> bool:
    err = body.get("error", {})
    return set(err) == {"message", "type", "param", "code"} and err["code"] == code \
        and bool(err["message"])


def test_the_ingress_answers_unknown_routes_and_methods_in_openai_shape() -> None:
    from pagedserve.cluster.serve_app import api

    client = TestClient(api)
    for method, path, status in (("GET", "/v1/files/file_1", 404),
                                 ("POST", "/v1/nope", 404),
                                 ("GET", "/v1/chat/completions", 405),
                                 ("DELETE", "/v1/models", 405)):
        r = client.request(method, path)
        assert r.status_code == status, (method, path, r.text)
        assert _is_openai_error(r.json(), status), r.json()
        assert path in r.json()["error"]["message"]


class Body(BaseModel):
    n: int


def test_api_errors_and_bad_bodies_too() -> None:
    app = FastAPI()  # the handlers serve_app's call
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)

    @app.post("/fail")
    async def fail(body: Body) -> dict:
        raise APIError("n is odd", param="n", status=422, headers={"x-why": "odd"})

    client = TestClient(app)
    r = client.post("/fail", json={"n": 3})
    assert r.status_code == 422 and r.headers["x-why"] == "odd"
    assert _is_openai_error(r.json(), 422) and r.json()["error"]["param"] == "n"
    bad = client.post("/fail", json={"n": "three"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
