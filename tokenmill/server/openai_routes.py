"""Handlers of /v1/completions, /v1/chat/completions, /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenmill.llm import apply_chat_template
from tokenmill.outputs import RequestOutput
from tokenmill.server.app import APIError, ServerState
from tokenmill.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                       error_body)

_DISCONNECT_POLL_S = 0.25


# ---------------------------------------------------------------------- shared steps
def _admit(state: ServerState, model: str | None):
    """Checks before any work: engine ready, model known, queue not full."""
    engine = state.ready_engine()
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist.", "not_found_error", "model")
    if engine.num_waiting >= state.args.max_queued_requests:
        state.metrics.rejected.inc()
        raise APIError(429, f"too many requests waiting ({engine.num_waiting}); retry shortly", "rate_limit_error",
                       headers={"Retry-After": "1"})
    return engine


def _max_tokens(state: ServerState, requested: int | None, n_prompt: int) -> int:
    engine = state.ready_engine().engine
    limit = state.args.max_tokens_limit
    if requested is not None and limit is not None and requested > limit:
        raise APIError(400, f"max_tokens must be at most {limit}, got {requested}", param="max_tokens")
    try:
        max_tokens = engine.resolve_max_tokens(n_prompt, requested)
    except ValueError as e:
        raise APIError(400, str(e), param="messages" if requested is None else "max_tokens") from None
    return min(max_tokens, limit) if limit else max_tokens


def _sampling(state, body, max_tokens, logprobs):
    try:
        params = body.to_sampling_params(state.ready_engine().engine.default_sampling_params(), max_tokens, logprobs)
        params.validate_for_vocab(state.ready_engine().engine.vocab_size)
        return params
    except ValueError as e:
        raise APIError(400, str(e)) from None


async def _encode(state: ServerState, text: str, add_special_tokens: bool = True) -> list[int]:
    tok = state.tokenizer
    # Tokenising a long prompt takes a while: keep it off the event loop.
    return await asyncio.get_running_loop().run_in_executor(
        None, lambda: tok.encode(text, add_special_tokens=add_special_tokens))


async def _watch(request: Request, agen: AsyncIterator):
    """Yield from agen, giving up (and so aborting its requests) as soon as the client disconnects.

    Waiting requests send nothing, so a broken connection would otherwise go unnoticed until the first
    token; the connection is polled while no output is ready.
    """
    it = agen.__aiter__()
    pending = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=_DISCONNECT_POLL_S)
            if not done:
                if await request.is_disconnected():
                    return
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await agen.aclose()


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, s):
        try:
            async for out in s:
                await q.put((i, out))
        except BaseException as e:  # surfaced to the consumer
            await q.put((i, e))
        finally:
            await q.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _streaming(events: AsyncIterator[str]) -> StreamingResponse:
    """SSE response: the events, an error event if they fail midway, then [DONE]."""
    async def framed():
        try:
            async for event in events:
                yield event
        except asyncio.CancelledError:
            raise
        except Exception as e:
            yield _sse(_stream_error(e))
        yield "data: [DONE]\n\n"

    return StreamingResponse(framed(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---------------------------------------------------------------------- completions
async def completions(state: ServerState, body: CompletionRequest, request: Request):
    engine = _admit(state, body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    prompts = body.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    encoded = []
    vocab = engine.engine.vocab_size
    for p in prompts:
        if isinstance(p, str):
            ids = await _encode(state, p)
        else:
            ids = list(p)
            if any(t < 0 or t >= vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        encoded.append((p if isinstance(p, str) else None, ids))
    requested = body.max_tokens if body.max_tokens is not None else 16
    params = [_sampling(state, body, _max_tokens(state, requested, len(ids)), body.logprobs) for _, ids in encoded]

    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    streams = [engine.generate(f"{rid}-{i}", ids, sp, text) for i, ((text, ids), sp) in enumerate(zip(encoded, params))]
    n = body.n
    tok = state.tokenizer

    def choice_logprobs(c, start: int, prompt_text_len: int):
        if body.logprobs is None or c.logprobs is None:
            return None
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = prompt_text_len + sum(len(tok.decode([t])) for t in c.token_ids[:start])
        for t, d in zip(c.token_ids[start:], c.logprobs[start:]):
            s = d[t].decoded_token
            lp["tokens"].append(s)
            lp["token_logprobs"].append(d[t].logprob)
            lp["top_logprobs"].append({v.decoded_token: v.logprob for k, v in d.items() if v.rank <= body.logprobs}
                                      or {s: d[t].logprob})
            lp["text_offset"].append(offset)
            offset += len(s)
        return lp

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events():
            sent_text = {}
            sent_tokens = {}
            final: dict[int, RequestOutput] = {}
            async for i, out in _watch(request, _merge(streams)):
                for c in out.outputs:
                    idx = i * n + c.index
                    prev = sent_text.get(idx)
                    text = c.text
                    echo = ""
                    if prev is None and body.echo:
                        echo = encoded[i][0] if encoded[i][0] is not None else tok.decode(encoded[i][1])
                    delta = echo + text[len(prev or ""):]
                    start = sent_tokens.get(idx, 0)
                    if not delta and c.finish_reason is None and len(c.token_ids) == start:
                        continue
                    sent_text[idx], sent_tokens[idx] = text, len(c.token_ids)
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                                "choices": [{"index": idx, "text": delta, "logprobs": choice_logprobs(c, start, 0),
                                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
                if out.finished:
                    final[i] = out
            if include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                            "choices": [], "usage": _usage_of(final.values())})

        return _streaming(events())

    async def collect():
        finals = {}
        async for i, out in _watch(request, _merge(streams)):
            if out.finished:
                finals[i] = out
        return [finals[i] for i in range(len(streams))] if len(finals) == len(streams) else None

    outs = await _run(request, collect())
    choices = []
    for i, out in enumerate(outs):
        prompt_text = ""
        if body.echo:
            prompt_text = encoded[i][0] if encoded[i][0] is not None else tok.decode(encoded[i][1])
        for c in out.outputs:
            choices.append({"index": i * n + c.index, "text": prompt_text + c.text,
                            "logprobs": choice_logprobs(c, 0, len(prompt_text)),
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
            "choices": choices, "usage": _usage_of(outs)}


def _usage_of(outs) -> dict:
    outs = list(outs)
    return _usage(sum(len(o.prompt_token_ids) for o in outs),
                  sum(len(c.token_ids) for o in outs for c in o.outputs),
                  sum(o.num_cached_tokens for o in outs))


def _stream_error(e: Exception) -> dict:
    if isinstance(e, APIError):
        return error_body(e.message, e.type, e.status, e.param)
    if isinstance(e, ValueError):
        return error_body(str(e), "invalid_request_error", 400)
    return error_body("internal server error" if not str(e) else str(e), "server_error", 500)


async def _run(request: Request, coro):
    try:
        result = await coro
    except ValueError as e:
        raise APIError(400, str(e)) from None
    if result is None:  # the client left; nobody reads this answer
        raise APIError(499, "client disconnected")
    return result


# ---------------------------------------------------------------------- chat
async def chat_completions(state: ServerState, body: ChatCompletionRequest, request: Request):
    engine = _admit(state, body.model)
    if body.chat_template is not None and not state.args.allow_request_chat_template:
        raise APIError(400, "chat_template in a request is refused by this server (start it with "
                            "--allow-request-chat-template to allow it)", param="chat_template")
    try:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt = apply_chat_template(state.tokenizer, messages, body.chat_template, body.add_generation_prompt)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    except Exception as e:  # a template error (sandbox violation, bad syntax, raise_exception)
        raise APIError(400, f"the chat template could not be rendered: {e}", param="messages") from None
    ids = await _encode(state, prompt, add_special_tokens=False)
    requested = body.max_completion_tokens or body.max_tokens
    top = body.top_logprobs if body.logprobs else None
    if body.top_logprobs is not None and not body.logprobs:
        top = None
    params = _sampling(state, body, _max_tokens(state, requested, len(ids)), (top or 0) if body.logprobs else None)

    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    stream = engine.generate(rid, ids, params, prompt)

    def logprob_entries(c, start: int):
        if not body.logprobs or c.logprobs is None:
            return None
        content = []
        for t, d in zip(c.token_ids[start:], c.logprobs[start:]):
            s = d[t].decoded_token
            tops = sorted((v for v in d.values() if v.rank <= (top or 0)), key=lambda v: v.rank)
            content.append({"token": s, "logprob": d[t].logprob, "bytes": list(s.encode()),
                            "top_logprobs": [{"token": v.decoded_token, "logprob": v.logprob,
                                              "bytes": list(v.decoded_token.encode())} for v in tops]})
        return {"content": content}

    def chunk(choices, usage=None):
        body_ = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                 "choices": choices}
        if usage is not None:
            body_["usage"] = usage
        return _sse(body_)

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events():
            sent_text: dict[int, str] = {}
            sent_tokens: dict[int, int] = {}
            finished: set[int] = set()
            final = None
            for i in range(body.n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async for _, out in _watch(request, _merge([stream])):
                for c in out.outputs:
                    prev = sent_text.get(c.index, "")
                    start = sent_tokens.get(c.index, 0)
                    delta = c.text[len(prev):]
                    if delta or len(c.token_ids) > start:
                        sent_text[c.index], sent_tokens[c.index] = c.text, len(c.token_ids)
                        if delta or body.logprobs:
                            yield chunk([{"index": c.index, "delta": {"content": delta},
                                          "logprobs": logprob_entries(c, start), "finish_reason": None}])
                    if c.finish_reason is not None and c.index not in finished:
                        finished.add(c.index)
                        yield chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}])
                if out.finished:
                    final = out
            if include_usage and final is not None:
                yield chunk([], _usage_of([final]))

        return _streaming(events())

    async def collect():
        async for _, out in _watch(request, _merge([stream])):
            if out.finished:
                return out

    out = await _run(request, collect())
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": logprob_entries(c, 0), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
               for c in out.outputs]
    return {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
            "choices": choices, "usage": _usage_of([out])}


# ---------------------------------------------------------------------- tokenizer endpoints
async def tokenize(state: ServerState, body: TokenizeRequest):
    state.ready_engine()
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        try:
            text = apply_chat_template(state.tokenizer, [{"role": m.role, "content": m.text()} for m in body.messages],
                                       None, body.add_generation_prompt)
        except Exception as e:
            raise APIError(400, f"the chat template could not be rendered: {e}", param="messages") from None
        ids = await _encode(state, text, add_special_tokens=False)
    else:
        ids = await _encode(state, body.prompt, add_special_tokens=body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": state.ready_engine().engine.max_model_len}


async def detokenize(state: ServerState, body: DetokenizeRequest):
    engine = state.ready_engine()
    vocab = engine.engine.vocab_size
    if any(t < 0 or t >= vocab for t in body.tokens):
        raise APIError(400, f"tokens must be in [0, {vocab})", param="tokens")
    return {"prompt": state.tokenizer.decode(body.tokens)}

