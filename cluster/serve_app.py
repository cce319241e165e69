"""Ray Serve application: an OpenAI-compatible ingress in front of engine replicas.

``OpenAIServer`` (FastAPI through ``serve.ingress``) validates, tokenises, applies the chat
template and computes each prompt's prefix-cache block hashes; the ``PrefixAffinityRouter``
of its handle picks an ``EngineServer`` replica from them. Each engine replica owns one
``AsyncEngine`` (and, for tensor parallelism, its rank actors in the replica's placement
group). A request is one ``EngineServer.run`` call; its per-step deltas come back on the
ingress's channel, one multiplexed stream per replica (``channel``). A client that goes
away cancels the ingress task, which cancels the call; Serve cancels the replica's task,
whose ``finally`` aborts the request in the scheduler, so its blocks are free before the
next step.

``build_app`` serves the CLI; ``app_builder`` is the import path for ``serve run``.
"""

# No ``from __future__ import annotations`` here: FastAPI must see real types on the
# ingress methods, which ``serve.ingress`` rewraps outside this module's namespace.
import asyncio
import dataclasses
import hmac
import logging
import os
from collections.abc import AsyncIterator, Mapping
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from pagedserve.cluster.admin_api import EngineAdmin
from pagedserve.cluster.admin_api import router as admin_router
from pagedserve.cluster.beam_serving import answer_beam_search
from pagedserve.cluster.channel import ChannelClient
from pagedserve.cluster.chat_protocol import ChatCompletionRequest, ChatMessage
from pagedserve.cluster.dispatch import FailoverPolicy, merge_streams
from pagedserve.cluster.embeds_api import decoded_embeds, routed_embeds_request
from pagedserve.cluster.engine_server import ENGINE_DEPLOYMENT, EngineServer
from pagedserve.cluster.harmony import default_parser
from pagedserve.cluster.http_errors import api_error, http_error, validation_error
from pagedserve.cluster.image_chat import (
    affinity_images,
    chat_images,
    image_chat_ids,
    request_image_info,
    written_out,
)
from pagedserve.cluster.lora_serving import (
    AdapterCatalog,
    LoRAEndpoints,
    ModelEndpoints,
    models_router,
)
from pagedserve.cluster.lora_serving import router as lora_router
from pagedserve.cluster.metrics import (
    HttpMetrics,
    HttpMetricsMiddleware,
)
from pagedserve.cluster.observe_api import ClusterView
from pagedserve.cluster.observe_api import router as observe_router
from pagedserve.cluster.pixel_storage import own_storage
from pagedserve.cluster.placement import ingress_actor_options
from pagedserve.cluster.pooling_api import PoolingEndpoints
from pagedserve.cluster.pooling_api import router as pooling_router
from pagedserve.cluster.processor_options import MediaList
from pagedserve.cluster.protocol import APIError, CompletionRequest, max_tokens_for
from pagedserve.cluster.reasoning import defer_constraint, thought_closed
from pagedserve.cluster.request_ids import request_ids
from pagedserve.cluster.response_store import ResponseStoreServer, StoreClient
from pagedserve.cluster.responses import (
    Formatter,
    ResponseState,
    render_response,
)
from pagedserve.cluster.responses_api import ResponsesEndpoint
from pagedserve.cluster.responses_api import router as responses_router
from pagedserve.cluster.responses_stored import StoredResponsesEndpoints
from pagedserve.cluster.responses_stored import router as stored_router
from pagedserve.cluster.router import (
    known_replicas,
    routed_request,
)
from pagedserve.cluster.serve_args import ServeArgs
from pagedserve.cluster.tokenize_api import TokenizeEndpoints
from pagedserve.cluster.tokenize_api import router as tokenize_router
from pagedserve.cluster.tools import ToolContext, chat_prompt_ids, mistral_tool_format
from pagedserve.cluster.wire import EngineRequest

logger = logging.getLogger(__name__)

INGRESS_DEPLOYMENT = "OpenAIServer"


api = FastAPI(title="pagedserve", docs_url=None, redoc_url=None)
_http = HttpMetrics()


@api.exception_handler(APIError)
async def _api_error(raw: Request, e: APIError) -> JSONResponse:
    return await api_error(raw, e)


@api.exception_handler(RequestValidationError)
async def _validation_error(raw: Request, e: RequestValidationError) -> JSONResponse:
    return await validation_error(raw, e)


@api.exception_handler(HTTPException)
async def _http_error(raw: Request, e: HTTPException) -> JSONResponse:
    return await http_error(raw, e)


api.add_middleware(HttpMetricsMiddleware, metrics=_http)


api.include_router(admin_router)
api.include_router(observe_router)
api.include_router(responses_router)
api.include_router(stored_router)
api.include_router(tokenize_router)
api.include_router(pooling_router)
api.include_router(lora_router)
api.include_router(models_router)


@serve.deployment(name=INGRESS_DEPLOYMENT, max_ongoing_requests=4096,
                  ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class OpenAIServer(EngineAdmin, ClusterView, ResponsesEndpoint, StoredResponsesEndpoints,
                   TokenizeEndpoints, PoolingEndpoints, LoRAEndpoints, ModelEndpoints):
    """The HTTP front: OpenAI API, health, metrics and stats over every engine replica."""

    def __init__(self, engine: DeploymentHandle, model: str | None = None,
                 served_model_name: str | list[str] | None = None,
                 api_key: str | None = None,
                 lora_modules: dict[str, str] | None = None, lora_dir: str | None = None,
                 pooling_type: str | None = None, reasoning_parser: str | None = None,
                 scales_to_zero: bool = False, prefill: DeploymentHandle | None = None,
                 failover: FailoverPolicy | None = None,
                 allow_runtime_lora_updating: bool = False,
                 responses_store: DeploymentHandle | None = None,
                 allowed_local_media_path: str | None = None) -> None:
        from pagedserve.worker.loaders import load_tokenizer, resolve_model

        resolved = resolve_model(model)
        self.tokenizer = load_tokenizer(resolved)
        self.mistral_tools = mistral_tool_format(self.tokenizer)
        self.model_id = resolved.model_id
        # vLLM's served names: the first answers in responses, each names the model.
        names = [served_model_name] if isinstance(served_model_name, str) \
            else list(served_model_name or [resolved.model_id])
        self.served_name = names[0]
        self.aliases = [n for n in dict.fromkeys(names[1:]) if n != names[0]]
        self.base_names = (self.served_name, *self.aliases, self.model_id)
        self.api_key = api_key
        self.app_name = serve.get_replica_context().app_name
        self._engine = engine
        self._channel = ChannelClient(
            engine, lambda: known_replicas(ENGINE_DEPLOYMENT, self.app_name),
            ray.get_runtime_context().current_actor)
        self._info: dict[str, Any] | None = None
        self._info_lock = asyncio.Lock()
        self.fmt = Formatter(self.tokenizer, self.served_name)
        self.adapters = AdapterCatalog(lora_modules, lora_dir, self.base_names)
        self.pooling_type = pooling_type
        self.reasoning_parser = reasoning_parser or default_parser(resolved.path)
        # autoscaling_config min_replicas = 0: no engine replica is a healthy, idle state.
        self.scales_to_zero = scales_to_zero
        self._prefill = prefill  # a disaggregated app's prefill pool (stats, pooling)
        self.failover = failover or FailoverPolicy()
        self.lora_updates = allow_runtime_lora_updating
        self.responses_store = StoreClient(responses_store) if responses_store else None
        self.http_metrics = _http
        self.allowed_local_media_path = allowed_local_media_path

    # ---- plumbing -----------------------------------------------------------------------

    def _authorize(self, raw: Request) -> None:
        given = raw.headers.get("authorization", "").encode()
        if self.api_key and not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
            raise APIError("invalid or missing API key", status=401,
                           type="authentication_error", code="invalid_api_key")

    def _check_model(self, name: str | None) -> tuple[str, str] | None:
        """None for the base model, ``(name, path)`` for a LoRA adapter, named alone (vLLM)
        or as ``BASE:ADAPTER`` (Ray Serve LLM); else a 404."""
        if name is None or name in self.base_names:
            return None
        base, sep, adapter = name.partition(":")
        lora = self.adapters.lookup(adapter if sep and base in self.base_names else name)
        if lora is None:
            more = " or a LoRA adapter (GET /v1/models)" if self.adapters.enabled else ""
            raise APIError(f"model {name!r} does not exist; this server serves "
                           f"{self.served_name!r}{more}", status=404, param="model",
                           code="model_not_found")
        return lora

    async def _engine_info(self) -> dict[str, Any]:
        """Model facts from any replica, fetched once (a burst must not fan out to them)."""
        if self._info is None:
            async with self._info_lock:
                if self._info is None:
                    try:
                        self._info = await self._engine.info.remote()
                    except BackPressureError:
                        raise APIError("server overloaded, retry later", status=503,
                                       type="server_overloaded", code="overloaded",
                                       headers={"Retry-After": "1"}) from None
        return self._info

    async def _respond(self, rid: str, reqs: list[EngineRequest], kind: str, stream: bool,
                       include_usage: bool, continuous_usage: bool, logprobs: bool,
                       echo: list[tuple[str, list[int]]] | None = None,
                       tools: ToolContext | None = None, include_reasoning: bool = True,
                       thought_closed: bool = False, tokens_as_ids: bool = False,
                       prompt_logprobs: int | None = None, token_ids: bool = False
                       ) -> Response:
        state, chunks = self._start(rid, reqs, kind, logprobs, echo, tools, include_reasoning,
                                    thought_closed, tokens_as_ids)
        if prompt_logprobs is not None:  # vLLM's field, from the chunks' prompt logprobs
            state.want_prompt_logprobs(prompt_logprobs, [r.prompt_token_ids for r in reqs])
        if token_ids:  # vLLM's return_token_ids (an embeddings prompt has no ids)
            state.want_token_ids([None if r.prompt_embeds is not None else r.prompt_token_ids
                                  for r in reqs])
        return await render_response(self.fmt, state, chunks, stream, include_usage,
                                     continuous_usage)

    def _start(self, rid: str, reqs: list[EngineRequest], kind: str, logprobs: bool,
               echo: list[tuple[str, list[int]]] | None = None,
               tools: ToolContext | None = None, include_reasoning: bool = True,
               thought_closed: bool = False, tokens_as_ids: bool = False
               ) -> tuple[ResponseState, AsyncIterator[tuple[int, Any]]]:
        """Send ``reqs`` to the replicas: the state their chunks fold into, and the chunks."""
        lora = reqs[0].lora
        state = ResponseState(kind, rid, [(len(r.prompt_token_ids), r.params.n) for r in reqs],
                              logprobs, reqs[0].params.logprobs, echo, tools,
                              lora[0] if lora is not None else None,
                              self.reasoning_parser if kind == "chat.completion" else None,
                              include_reasoning, thought_closed, tokens_as_ids)
        return state, merge_streams(self._channel, self._engine, reqs, _http.record_failover,
                                    self.failover)

    # ---- endpoints ---------------------------------------------------------------------

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        self._authorize(raw)
        body.check()
        lora = self._check_model(body.model)
        info = await self._engine_info()
        rid, eid = request_ids("cmpl", body.request_id, raw.headers.get("x-request-id"))
        reqs, echo = [], []
        prompts: list[Any] = [*decoded_embeds(body, info), *body.prompts()]  # embeds first
        for i, p in enumerate(prompts):
            embeds = None if isinstance(p, (str, list)) else p
            ids = [0] * len(p) if embeds is not None else \
                self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            if any(not isinstance(t, int) or not 0 <= t < info["vocab_size"] for t in ids):
                raise APIError("prompt token ids must be within the vocabulary",
                               param="prompt")
            ids = body.truncate(ids)
            params = body.sampling_params(
                max_tokens_for(body.max_tokens, len(ids), info, "max_tokens", body.n,
                               prompt_param="prompt" if embeds is None else "prompt_embeds"),
                body.logprobs, info["vocab_size"])
            if body.echo:  # the prompt's own logprobs lead the choice's when both are asked
                whole = isinstance(p, str) and body.truncate_prompt_tokens is None
                echo.append((p if whole else self.tokenizer.decode(ids), ids))
                if body.logprobs is not None:
                    params = dataclasses.replace(params, prompt_logprobs=max(
                        body.logprobs, body.prompt_logprobs or 0))
            reqs.append(routed_request(f"{eid}-{i}", ids, params, body.cache_salt, info,
                                       body.stream, lora, body.priority) if embeds is None
                        else routed_embeds_request(f"{eid}-{i}",
                                                   own_storage(embeds[-len(ids):]), params,
                                                   body.cache_salt, info, body.stream, lora,
                                                   body.priority))
        if body.use_beam_search:
            return await answer_beam_search(
                self._engine, "text_completion", rid, lora[0] if lora else self.served_name,
                body, reqs, {"echo": body.echo, "logprobs": body.logprobs is not None})
        so = body.stream_options
        return await self._respond(rid, reqs, "text_completion", body.stream,
                                   bool(so and so.include_usage),
                                   bool(so and so.continuous_usage_stats),
                                   body.logprobs is not None, echo if body.echo else None,
                                   tokens_as_ids=body.return_tokens_as_token_ids,
                                   prompt_logprobs=body.prompt_logprobs,
                                   token_ids=bool(body.return_token_ids))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self._authorize(raw)
        body.check()
        rid, eid = request_ids("chatcmpl", body.request_id, raw.headers.get("x-request-id"))
        req, tools, closed = await self._chat_request(eid, body)
        if body.use_beam_search:
            lora = req.lora
            return await answer_beam_search(
                self._engine, "chat.completion", rid, lora[0] if lora else self.served_name,
                body, [req], {"logprobs": bool(body.logprobs), "tools": bool(body.tools)},
                None if closed else self.reasoning_parser)
        so = body.stream_options
        return await self._respond(rid, [req], "chat.completion", body.stream,
                                   bool(so and so.include_usage),
                                   bool(so and so.continuous_usage_stats), body.logprobs,
                                   tools=tools, include_reasoning=body.include_reasoning,
                                   thought_closed=closed,
                                   tokens_as_ids=body.return_tokens_as_token_ids,
                                   prompt_logprobs=body.prompt_logprobs,
                                   token_ids=bool(body.return_token_ids))

    async def _chat_request(self, rid: str, body: ChatCompletionRequest
                            ) -> tuple[EngineRequest, ToolContext | None, bool]:
        """A checked chat body as the engine request (``rid``, the engine's id), its tool
        context, and whether the prompt already closed a reasoning model's thought."""
        lora = self._check_model(body.model)
        info = await self._engine_info()
        tools = ToolContext.from_request(body.tools, body.tool_choice, body.parallel_tool_calls,
                                         self.mistral_tools)
        info = request_image_info(info, body.mm_processor_kwargs)
        images = await chat_images(body.messages, info, self.allowed_local_media_path)
        ids = self._chat_ids(body.messages, body.add_generation_prompt, body.tools,
                             body.chat_template_kwargs, body.continue_final_message, info,
                             images)
        ids = body.truncate(written_out(ids, images, info["image"]) if images else ids)
        params = body.sampling_params(
            max_tokens_for(body.requested_max_tokens(), len(ids), info,
                           body.max_tokens_param, body.n),
            body.engine_logprobs(), info["vocab_size"],
            tools.structured() if tools is not None else None)
        if tools is not None and tools.keeps_special_tokens:  # [TOOL_CALLS] is one
            params.skip_special_tokens = False
        closed = thought_closed(self.tokenizer, ids)
        params = defer_constraint(params, self.reasoning_parser, closed, body)
        req = routed_request(rid, ids, params, body.cache_salt, info, body.stream, lora,
                             body.priority,
                             affinity_images(ids, images, info["image"]) if images else ())
        req.images = (MediaList(images, body.mm_processor_kwargs)
                      if body.mm_processor_kwargs else images) if images else None
        return req, tools, closed

    def _chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool,
                  tools: list[dict[str, Any]] | None,
                  template_kwargs: dict[str, Any] | None,
                  continue_final_message: bool = False,
                  info: dict[str, Any] | None = None,
                  images: list[Any] | None = None) -> list[int]:
        """The chat's prompt ids; with images, each one's placeholder run written out as
        the model's processor writes it (``image_chat``; ``images``: the decoded ones,
        which Gemma 3's pan-and-scan needs to write the runs of their crops)."""
        dicts = [m.as_template_dict() for m in messages]
        if any(m.media for m in messages):
            image = (info or {}).get("image")
            if not image:
                raise APIError("this model takes no images", param="messages")
            return image_chat_ids(self.tokenizer, dicts, image, add_generation_prompt, tools,
                                  template_kwargs, continue_final_message, images)
        return chat_prompt_ids(self.tokenizer, dicts, add_generation_prompt, tools,
                               template_kwargs, continue_final_message)


def build_app(args: ServeArgs | Mapping[str, Any] | Any | None = None) -> serve.Application:
    """The Serve application for ``args`` (a ``ServeArgs``, a mapping or an argparse result)."""
    a = ServeArgs.parse(args)
    s = a.settings()
    opts = a.engine_options(s)
    prefill = None
    if a.prefill_replicas:  # disaggregated: the engine replicas decode, these prefill
        prefill = EngineServer.options(**a.prefill_options(opts)).bind(s.engine_kwargs)
    engine = EngineServer.options(**opts).bind(s.engine_kwargs, a.stream_interval_ms,
                                               a.stream_messages_per_s, prefill,
                                               a.remote_prefill(), a.checkpoint_interval_ms)
    api_key = a.api_key or os.environ.get("PAGEDSERVE_API_KEY") or None
    store = ResponseStoreServer.options(
        graceful_shutdown_wait_loop_s=a.graceful_shutdown_wait_loop_s,
    ).bind(a.responses_store_max_entries) if a.enable_responses_store else None
    return OpenAIServer.options(
        # The ingress outlives its engine replicas' drain: what the drain cuts off must
        # still resume (a redeploy) or end with an error event (a deletion).
        num_replicas=a.ingress_replicas,
        graceful_shutdown_timeout_s=a.drain_timeout_s + a.failover_wait_s,
        graceful_shutdown_wait_loop_s=a.graceful_shutdown_wait_loop_s,
        ray_actor_options=ingress_actor_options(a.ingress_on_head),
    ).bind(engine, a.model, a.served_model_name, api_key, s.lora_modules, s.lora_dir,
           a.pooling_type, a.reasoning_parser,
           a.scales_to_zero(), prefill, FailoverPolicy(a.resume_streams, a.failover_wait_s),
           a.allow_runtime_lora_updating, responses_store=store,
           allowed_local_media_path=a.allowed_local_media_path)


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Import path for ``serve run``/``serve deploy`` configs (``args:`` are ``ServeArgs``)."""
    return build_app(ServeArgs(**(args or {})))
