"""OpenAI-compatible responses: full JSON bodies and SSE events from engine chunks.

``ResponseState`` (``response_state``) accumulates one response's choices;
``Formatter`` folds each ``EngineChunk`` into it and renders either the final body
or one SSE event per step, including logprobs in the completions and chat shapes
and ``usage`` with ``prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.cluster.harmony import HARMONY, harmony_message, harmony_stream_calls
from pagedserve.cluster.protocol import APIError
from pagedserve.cluster.reasoning import ReasoningStream, split_reasoning
from pagedserve.cluster.response_state import Choice, ResponseState, now, usage
from pagedserve.cluster.tools import ToolContext, ToolStream

__all__ = ["Formatter", "ResponseState", "now", "render_response", "sse", "started", "usage"]


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _likeliest(entry: dict[int, float], n: int | None, keep: int) -> dict[int, float]:
    """``entry``'s ``n`` likeliest tokens, and ``keep``."""
    best = set(sorted(entry, key=lambda t: -entry[t])[:n])
    return {t: v for t, v in entry.items() if t == keep or t in best}


class Formatter:
    """Engine chunks to OpenAI JSON (full responses and SSE events); owns the tokenizer."""

    def __init__(self, tokenizer: Any, model_name: str) -> None:
        self.tok, self.model = tokenizer, model_name

    def _text(self, token_id: int) -> str:
        return self.tok.decode([token_id])

    def _label(self, token_id: int, as_id: bool) -> str:
        """How a logprob entry names a token: its text, or ``token_id:N``."""
        return f"token_id:{token_id}" if as_id else self._text(token_id)

    def _chat_logprobs(self, tokens: list[int], tops: list[dict[int, float]],
                       sampled: list[float | None], top_n: int | None = None,
                       as_id: bool = False) -> list[dict[str, Any]]:
        out = []
        for tid, top, lp in zip(tokens, tops, sampled):
            s = self._label(tid, as_id)
            out.append({"token": s, "logprob": lp, "bytes": list(self._text(tid).encode()),
                        "top_logprobs": [{"token": self._label(t, as_id), "logprob": v,
                                          "bytes": list(self._text(t).encode())}
                                         for t, v in sorted(top.items(),
                                                            key=lambda kv: -kv[1])[:top_n]]})
        return out

    def _completion_logprobs(self, tokens: list[int], tops: list[dict[int, float]],
                             sampled: list[float | None], offset: int,
                             as_id: bool = False) -> dict[str, Any]:
        strs, offsets = [], []
        for tid in tokens:
            strs.append(self._label(tid, as_id))
            offsets.append(offset)
            offset += len(self._text(tid))  # offsets stay in the text
        return {"tokens": strs, "token_logprobs": list(sampled),
                "top_logprobs": [{self._label(t, as_id): v for t, v in
                                  sorted(top.items(), key=lambda kv: -kv[1])} for top in tops],
                "text_offset": offsets}

    def _apply(self, st: ResponseState, i: int, chunk: Any
               ) -> list[tuple[int, Any, Any, str]]:
        """Fold a chunk into ``st``; returns ``(choice index, delta, delta logprobs, delta
        text)`` (the text and logprobs lead with the echoed prompt on a choice's first)."""
        st.cached[i] = max(st.cached[i], chunk.cached_tokens)
        if st.prompt_lp_k is not None and chunk.prompt_logprobs is not None:
            st.prompt_lps[i] = self._vllm_prompt_logprobs(
                st.prompt_ids[i], chunk.prompt_logprobs, chunk.prompt_ranks, st.prompt_lp_k)
        out = []
        for d in chunk.deltas:
            c_idx = st.offsets[i] + d.index
            c = st.choices[c_idx]
            echo_text, echo_lp = "", None
            if st.echo is not None and not c.echoed:
                echo_text, echo_lp = self._echo(st, c, *st.echo[i], chunk.prompt_logprobs)
            lp = None
            if st.logprobs and d.logprobs is not None:
                sampled = d.sampled_logprobs or [None] * len(d.token_ids)
                if st.kind == "chat.completion":
                    lp = self._chat_logprobs(d.token_ids, d.logprobs, sampled, st.top_n,
                                             st.tokens_as_ids)
                    c.logprobs = (c.logprobs or []) + lp
                else:
                    lp = self._completion_logprobs(d.token_ids, d.logprobs, sampled,
                                                   sum(len(t) for t in c.text),
                                                   st.tokens_as_ids)
                    if c.logprobs is None:
                        c.logprobs = {k: [] for k in lp}
                    for k, v in lp.items():
                        c.logprobs[k].extend(v)
            c.text.append(d.text)
            c.num_tokens += len(d.token_ids)
            if st.token_ids is not None:
                c.token_ids.extend(d.token_ids)
            c.finish_reason = d.finish_reason or c.finish_reason
            c.stop_reason = d.stop_reason if d.finish_reason else c.stop_reason
            if echo_lp is not None:
                lp = echo_lp if lp is None else {k: echo_lp[k] + v for k, v in lp.items()}
            out.append((c_idx, d, lp, echo_text + d.text))
        return out

    def _vllm_prompt_logprobs(self, ids: list[int], entries: list[dict[int, float] | None],
                              ranks: list[int | None] | None, k: int
                              ) -> list[dict[str, Any] | None]:
        """vLLM's shape: per prompt token (None for the first) ``{token id: {logprob,
        rank, decoded_token}}``, the token itself first, then the ``k`` likeliest (the
        entries may hold more, when ``echo`` asked for more)."""
        out: list[dict[str, Any] | None] = []
        for pos, (tid, e) in enumerate(zip(ids, entries)):
            if e is None:
                out.append(None)
                continue
            rank = ranks[pos] if ranks is not None else None
            d = {str(tid): {"logprob": e[tid], "rank": rank, "decoded_token": self._text(tid)}}
            for r, t in enumerate(sorted(e, key=lambda t: -e[t])[:k], 1):
                d.setdefault(str(t), {"logprob": e[t], "rank": r,
                                      "decoded_token": self._text(t)})
            out.append(d)
        return out

    def _echo(self, st: ResponseState, c: Choice, text: str, ids: list[int],
              prompt_lps: list[dict[int, float] | None] | None
              ) -> tuple[str, dict[str, list[Any]] | None]:
        """Lead the choice with its prompt: the text and, with logprobs, each prompt
        token's logprob given the ones before it (None for the first, as OpenAI).
        Returns the text and logprobs it added."""
        c.echoed = True
        c.text.append(text)
        if not st.logprobs:
            return text, None
        entries = prompt_lps if prompt_lps is not None else [None] * len(ids)
        if st.prompt_lp_k is not None:  # the engine's entries may hold more alternatives
            entries = [None if e is None else _likeliest(e, st.top_n, tid)
                       for e, tid in zip(entries, ids)]
        lp = self._completion_logprobs(ids, [e or {} for e in entries],
                                       [None if e is None else e.get(t)
                                        for e, t in zip(entries, ids)], 0, st.tokens_as_ids)
        lp["top_logprobs"] = [None if e is None else top
                              for e, top in zip(entries, lp["top_logprobs"])]
        c.logprobs = {k: list(v) for k, v in lp.items()}
        return text, lp

    def add(self, st: ResponseState, i: int, chunk: Any) -> None:
        self._apply(st, i, chunk)

    def full_response(self, st: ResponseState) -> dict[str, Any]:
        choices = []
        for k, c in enumerate(st.choices):
            text = "".join(c.text)
            if st.kind == "chat.completion":
                message, finish = self._chat_message(st, text, c.finish_reason)
                choices.append({"index": k, "message": message,
                                "logprobs": {"content": c.logprobs or []} if st.logprobs
                                else None,
                                "finish_reason": finish, "stop_reason": c.stop_reason})
            else:
                choices.append({"index": k, "text": text, "logprobs": c.logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                if st.prompt_lp_k is not None:  # vLLM's, per choice
                    choices[-1]["prompt_logprobs"] = st.prompt_lps[st.prompt_of(k)]
                if st.token_ids is not None:
                    choices[-1]["prompt_token_ids"] = st.token_ids[st.prompt_of(k)]
            if st.token_ids is not None:
                choices[-1]["token_ids"] = c.token_ids
        body = {"id": st.id, "object": st.kind, "created": st.created,
                "model": st.model or self.model, "choices": choices, "usage": st.usage()}
        if st.prompt_lp_k is not None and st.kind == "chat.completion":
            body["prompt_logprobs"] = st.prompt_lps[0]  # vLLM's, once for the prompt
        if st.token_ids is not None and st.kind == "chat.completion":
            body["prompt_token_ids"] = st.token_ids[0]
        return body

    @staticmethod
    def _chat_message(st: ResponseState, text: str, finish: str | None
                      ) -> tuple[dict[str, Any], str | None]:
        """A whole chat choice's message and finish reason: its thought split off under
        a reasoning parser, its tool calls parsed (a harmony answer's: ``harmony``)."""
        if st.reasoning == HARMONY:
            return harmony_message(text, st.tools, st.include_reasoning, finish)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if st.reasoning is not None:
            thought, message["content"] = split_reasoning(st.reasoning, text,
                                                          st.thought_closed)
            text = message["content"] or ""
            if st.include_reasoning:
                message["reasoning"] = message["reasoning_content"] = thought
        if st.tools is not None:
            message["content"], calls = st.tools.parse(text)
            if calls:
                message["tool_calls"] = calls
            finish = st.tools.finish_reason(calls, finish)
        return message, finish

    def stream_events(self, st: ResponseState, i: int, chunk: Any, continuous_usage: bool
                      ) -> list[str]:
        return [sse(ev) for ev in self.stream_chunks(st, i, chunk, continuous_usage)]

    def stream_chunks(self, st: ResponseState, i: int, chunk: Any, continuous_usage: bool
                      ) -> list[dict[str, Any]]:
        """The streamed chunk objects (one per choice the engine chunk advanced)."""
        events = []
        obj = "chat.completion.chunk" if st.kind == "chat.completion" else "text_completion"
        for c_idx, d, lp, text in self._apply(st, i, chunk):
            c = st.choices[c_idx]
            if st.kind == "chat.completion":
                delta: dict[str, Any] = {}
                content = self._reasoning_delta(st, c, d.text, bool(d.finish_reason), delta)
                if content or not delta:
                    delta["content"] = content
                finish = d.finish_reason
                if st.reasoning == HARMONY:  # its calls are the harmony stream's
                    assert c.reasoning_stream is not None
                    finish = harmony_stream_calls(c.reasoning_stream.calls, st.tools, delta,
                                                  finish)
                elif st.tools is not None:
                    delta["content"], finish = self._tool_delta(st.tools, c, content, delta,
                                                                finish)
                if not c.started:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": c_idx, "delta": delta,
                                          "logprobs": {"content": lp} if lp is not None else None,
                                          "finish_reason": finish}
            else:
                choice = {"index": c_idx, "text": text, "logprobs": lp,
                          "finish_reason": d.finish_reason}
                if st.token_ids is not None and not c.started:
                    choice["prompt_token_ids"] = st.token_ids[st.prompt_of(c_idx)]
            if d.finish_reason:
                choice["stop_reason"] = d.stop_reason
            if st.token_ids is not None:
                choice["token_ids"] = list(d.token_ids)
            ev = {"id": st.id, "object": obj, "created": st.created,
                  "model": st.model or self.model,
                  "choices": [choice]}
            if st.token_ids is not None and st.kind == "chat.completion" and not any(
                    x.started for x in st.choices):
                ev["prompt_token_ids"] = st.token_ids[0]
            c.started = True
            if continuous_usage:
                ev["usage"] = st.usage()
            events.append(ev)
        return events

    @staticmethod
    def _reasoning_delta(st: ResponseState, c: Choice, text: str, last: bool,
                         delta: dict[str, Any]) -> str:
        """Split a chat delta's text: the thought goes into ``delta`` (when included),
        the content is returned."""
        if st.reasoning is None:
            return text
        if c.reasoning_stream is None:
            c.reasoning_stream = ReasoningStream(st.reasoning, st.thought_closed)
        thought, content = c.reasoning_stream.feed(text)
        if last:
            more_thought, more = c.reasoning_stream.finish()
            thought, content = thought + more_thought, content + more
        if thought and st.include_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = thought
        return content

    @staticmethod
    def _tool_delta(tools: ToolContext, c: Choice, text: str, delta: dict[str, Any],
                    finish: str | None) -> tuple[str | None, str | None]:
        """The content a tool-using choice may show now; a named function's argument
        fragments, or at the end the other calls whole, go into ``delta``."""
        if c.tool_stream is None:
            c.tool_stream = ToolStream(tools)
        if tools.mode == "named":
            fragment = c.tool_stream.named_fragment(text)
            if fragment is not None:
                delta["tool_calls"] = [fragment]
            return None, finish
        content = c.tool_stream.feed(text)
        if not finish:
            return content, finish
        rest, calls = c.tool_stream.finish()
        if calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        return content + rest, tools.finish_reason(calls, finish)

    def usage_event(self, st: ResponseState) -> str:
        obj = "chat.completion.chunk" if st.kind == "chat.completion" else "text_completion"
        return sse({"id": st.id, "object": obj, "created": st.created,
                    "model": st.model or self.model,
                    "choices": [], "usage": st.usage()})


async def started(chunks: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Await the first chunk now, so an early error is a plain HTTP error (before a
    stream's 200); then every chunk, closing ``chunks`` when done."""
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await chunks.aclose()
        raise

    async def every() -> AsyncIterator[tuple[int, Any]]:
        try:
            if first is not None:
                yield first
            async for c in chunks:
                yield c
        finally:
            await chunks.aclose()

    return every()


async def render_response(fmt: Formatter, state: ResponseState,
                          chunks: AsyncIterator[tuple[int, Any]], stream: bool,
                          include_usage: bool, continuous_usage: bool) -> Response:
    """The HTTP answer from the replicas' chunks: one JSON body, or server-sent events."""
    if not stream:
        async for i, c in chunks:
            fmt.add(state, i, c)
        return JSONResponse(fmt.full_response(state))
    chunks = await started(chunks)

    async def events() -> AsyncIterator[str]:
        try:
            async for i, c in chunks:
                for ev in fmt.stream_events(state, i, c, continuous_usage):
                    yield ev
            if include_usage:
                yield fmt.usage_event(state)
        except APIError as e:
            yield sse(e.body())
        finally:
            await chunks.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
