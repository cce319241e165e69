"""Every error the ingress answers, in OpenAI's shape (``{"error": {...}}``): the API's
own ``APIError``s, request bodies that fail validation (400 naming the field), and
unknown routes or methods (404, 405), which FastAPI would answer as ``{"detail"}``.
OpenAI's clients read ``error.message`` and ``error.code`` from every one.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pagedserve.cluster.protocol import APIError, error_body, validation_error_body


def install_error_handlers(api: FastAPI) -> None:
    """Answer every error ``api`` raises with an OpenAI error body."""

    @api.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @api.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error_body(e.errors()), status_code=400)

    @api.exception_handler(HTTPException)
    async def _http_error(raw: Request, e: HTTPException) -> JSONResponse:
        body = error_body(f"{e.detail}: {raw.method} {raw.url.path}", code=e.status_code)
        return JSONResponse(body, status_code=e.status_code, headers=e.headers)
