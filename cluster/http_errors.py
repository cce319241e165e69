"""Every error the ingress answers, in OpenAI's shape (``{"error": {...}}``): the API's
own ``APIError``s, request bodies that fail validation (400 naming the field), and
unknown routes or methods (404, 405), which FastAPI would answer as ``{"detail"}``.
OpenAI's clients read ``error.message`` and ``error.code`` from every one.

``serve_app`` registers them with handlers of its own that call these: registered
straight from this module (``add_exception_handler`` with these functions), the
routes that Serve binds to the ingress class from the mixins' routers (``/tokenize``,
``/v1/score``, ...) were left unbound in the replicas and answered
``query.self: Field required`` (found on Ray 2.60 / FastAPI 0.165; why was not
established).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pagedserve.cluster.protocol import APIError, error_body, validation_error_body


async def api_error(_: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    return JSONResponse(validation_error_body(e.errors()), status_code=400)


async def http_error(raw: Request, e: HTTPException) -> JSONResponse:
    body = error_body(f"{e.detail}: {raw.method} {raw.url.path}", code=e.status_code)
    return JSONResponse(body, status_code=e.status_code, headers=e.headers)
