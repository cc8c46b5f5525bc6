"""Handlers of /v1/completions, /v1/chat/completions, /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenmill.engine.async_engine import AsyncEngine, RequestCutOffError, RequestFailedError, RequestStream
from tokenmill.llm import apply_chat_template
from tokenmill.outputs import RequestOutput
from tokenmill.server.app import APIError, ServerState
from tokenmill.server import reasoning, tools
from tokenmill.server.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from tokenmill.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, FieldError,
                                       TokenizeRequest, error_body)

_DISCONNECT_POLL_S = 0.25


# ---------------------------------------------------------------------- shared steps
def _admit(state: ServerState, model: str | None, sequences: int = 1) -> AsyncEngine:
    """Checks before any work: engine ready, model known, and places in the queue for the request's
    sequences (prompts x n), held until the request is added (or released if it fails before)."""
    engine = state.ready_engine()
    if state.draining:
        raise APIError(503, "the server is shutting down", "server_shutdown")
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist.", "not_found_error", "model")
    limit = state.args.max_queued_requests
    if sequences > limit:
        raise APIError(400, f"this request asks for {sequences} sequences (prompts x n); at most {limit} fit in "
                            "the queue (--max-queued-requests): send fewer prompts or a smaller n", param="n")
    if not engine.try_reserve(sequences, limit):
        state.metrics.rejected.inc()
        raise APIError(429, f"too many requests waiting ({engine.num_waiting}); retry shortly", "rate_limit_error",
                       headers={"Retry-After": "1"})
    return engine


@contextlib.contextmanager
def _reservation(engine: AsyncEngine, sequences: int):
    """Places held by _admit go back to the queue if the request fails before it is added."""
    try:
        yield
    except BaseException:
        engine.release(sequences)
        raise


def _max_tokens(state: ServerState, requested: int | None, n_prompt: int, prompt_param: str) -> int:
    engine = state.ready_engine().engine
    limit = state.args.max_tokens_limit
    if requested is not None and limit is not None and requested > limit:
        raise APIError(400, f"max_tokens must be at most {limit}, got {requested}", param="max_tokens")
    try:
        max_tokens = engine.resolve_max_tokens(n_prompt, requested)
    except ValueError as e:
        too_long = requested is None or n_prompt >= engine.max_model_len
        raise APIError(400, str(e), param=prompt_param if too_long else "max_tokens") from None
    return min(max_tokens, limit) if limit else max_tokens


def _sampling(state, body, max_tokens, logprobs, prompt_logprobs=None):
    try:
        params = body.to_sampling_params(state.ready_engine().engine.default_sampling_params(), max_tokens, logprobs,
                                         prompt_logprobs)
        params.validate_for_vocab(state.ready_engine().engine.vocab_size)
        return params
    except ValueError as e:
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None


async def _compile_constraint(state: ServerState, params, param: str | None) -> None:
    """Compile the request's output constraint (cached) off the event loop and off the engine thread, so
    a large schema holds up neither; a bad one is a 400 naming its field."""
    spec = params.structured_outputs
    if spec is None:
        return
    engine = state.ready_engine().engine
    try:
        await asyncio.get_running_loop().run_in_executor(None, engine.grammars.compile, spec)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None


async def _encode(state: ServerState, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate (JSON allows "\ud800"): no tokenizer takes it
        raise APIError(400, f"{param} is not valid Unicode text: {e.reason} at character {e.start}",
                       param=param) from None
    tok = state.tokenizer
    # Tokenising a long prompt takes a while: keep it off the event loop.
    return await asyncio.get_running_loop().run_in_executor(
        None, lambda: tok.encode(text, add_special_tokens=add_special_tokens))


async def _watch(request: Request, agen: AsyncIterator):
    """Yield from agen, giving up (and so aborting its requests) as soon as the client disconnects.

    The connection is checked every _DISCONNECT_POLL_S, whether or not output flows: a client waiting for
    a whole answer reads nothing until the end, so only the connection tells that it has gone.
    """
    it = agen.__aiter__()
    pending = None
    checked = time.monotonic()
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=_DISCONNECT_POLL_S)
            if time.monotonic() - checked >= _DISCONNECT_POLL_S or not done:
                checked = time.monotonic()
                if await request.is_disconnected():
                    return
            if not done:
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


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come, tagged with the stream's position; leaving
    early closes (aborts) every stream."""
    try:
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
    finally:
        for s in streams:
            await s.aclose()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _usage_of(outs, count_completion: bool = True) -> dict:
    outs = list(outs)
    return _usage(sum(len(o.prompt_token_ids) for o in outs),
                  sum(len(c.token_ids) for o in outs for c in o.outputs) if count_completion else 0,
                  sum(o.num_cached_tokens for o in outs))


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


def _stream_error(e: Exception) -> dict:
    if isinstance(e, RequestCutOffError):
        return error_body(str(e), "server_shutdown", 503)
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
    except RequestCutOffError as e:
        raise APIError(503, str(e), "server_shutdown") from None
    except RequestFailedError as e:
        raise APIError(500, f"the request failed: {e}", "server_error") from None
    if result is None:  # the client left; nobody reads this answer
        raise APIError(499, "client disconnected")
    return result


# ---------------------------------------------------------------------- completions
@dataclass(slots=True)
class _Choice:
    """What one completion choice has sent so far, so each streamed piece carries only what is new."""

    text: int = 0  # characters of the completion sent
    tokens: int = 0  # completion tokens whose logprobs were sent
    offset: int = 0  # text_offset of the next completion token
    started: bool = False  # the echoed prompt went out
    finished: bool = False


async def completions(state: ServerState, body: CompletionRequest, request: Request):
    prompts = body.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    sequences = len(prompts) * body.n
    engine = _admit(state, body.model, sequences)
    with _reservation(engine, sequences):
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        score_only = body.max_tokens == 0
        if score_only and not body.echo:
            raise APIError(400, "max_tokens 0 generates nothing: it scores the prompt, and needs echo", param="max_tokens")
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
        # Scoring a prompt computes one token past it, which is left out of the answer.
        requested = 1 if score_only else (body.max_tokens if body.max_tokens is not None else 16)
        prompt_lps = body.prompt_logprobs
        if body.echo and body.logprobs is not None:
            prompt_lps = max(prompt_lps or 0, body.logprobs)
        params = [_sampling(state, body, _max_tokens(state, requested, len(ids), "prompt"), body.logprobs, prompt_lps)
                  for _, ids in encoded]
        await _compile_constraint(state, params[0], body.structured()[1])
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = [engine.add(f"{rid}-{i}", ids, sp, text, reserved=True)
                   for i, ((text, ids), sp) in enumerate(zip(encoded, params))]
    created = int(time.time())
    n = body.n
    tok = state.tokenizer
    names = state.token_text
    as_ids = body.return_tokens_as_token_ids
    prompt_texts = [text if text is not None else tok.decode(ids) for text, ids in encoded]

    def piece(i: int, out: RequestOutput, c, sent: _Choice) -> dict | None:
        """The choice's next piece: new text (the echoed prompt first), its logprobs, the finish; None
        when there is nothing new. text_offset indexes the prompt followed by the completion."""
        prompt_ids = encoded[i][1]
        text, ids, entries = "", [], []
        first = not sent.started
        if first:
            sent.started = True
            sent.offset = 0 if body.echo else len(prompt_texts[i])
            if body.echo:
                text, ids = prompt_texts[i], list(prompt_ids)
                entries = list(out.prompt_logprobs or [None] * len(prompt_ids))
        if not score_only:
            text += c.text[sent.text:]
            sent.text = len(c.text)
            new_ids = c.token_ids[sent.tokens:]
            ids += new_ids
            entries += c.logprobs[sent.tokens:] if c.logprobs is not None else [None] * len(new_ids)
            sent.tokens = len(c.token_ids)
        finish = c.finish_reason
        if score_only and finish in ("stop", "length"):
            finish = "length"  # the token computed past the prompt is not part of the answer
        if not text and not ids and (finish is None or sent.finished):
            return None
        sent.finished = finish is not None
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(names, ids, entries, body.logprobs, sent.offset, as_ids)
            if ids:
                sent.offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        choice = {"index": i * n + c.index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": c.stop_reason}
        if first and body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(names, out.prompt_logprobs)
        return choice

    sent = {}

    def pieces(i: int, out: RequestOutput) -> list[dict]:
        found = (piece(i, out, c, sent.setdefault(i * n + c.index, _Choice())) for c in out.outputs)
        return [p for p in found if p is not None]

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)

        async def events():
            latest: dict[int, RequestOutput] = {}
            async for i, out in _watch(request, _merge(streams)):
                latest[i] = out
                for choice in pieces(i, out):
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                             "choices": [choice]}
                    if continuous:
                        chunk["usage"] = _usage_of(latest.values(), not score_only)
                    yield _sse(chunk)
            if include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                            "choices": [], "usage": _usage_of(latest.values(), not score_only)})

        return _streaming(events())

    async def collect():
        finals = {}
        async for i, out in _watch(request, _merge(streams)):
            if out.finished:
                finals[i] = out
        return [finals[i] for i in range(len(streams))] if len(finals) == len(streams) else None

    outs = await _run(request, collect())
    choices = [choice for i, out in enumerate(outs) for choice in pieces(i, out)]
    return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
            "choices": sorted(choices, key=lambda c: c["index"]), "usage": _usage_of(outs, not score_only)}


# ---------------------------------------------------------------------- chat
def chat_prompt(tokenizer, body: ChatCompletionRequest, fns: dict, mode: str, fmt) -> str:
    """The prompt text of a chat request as the chat template renders it, tools included (the data-parallel
    front renders it the same way to route the request)."""
    native = tools.template_handles_tools(body.chat_template or tokenizer.chat_template)
    messages = tools.render_messages([m.as_dict() for m in body.messages], fns, mode, native, fmt)
    listed = [{"type": "function", "function": f} for f in fns.values()] if native and mode != "none" else None
    return apply_chat_template(tokenizer, messages, body.chat_template, body.add_generation_prompt, tools=listed,
                               chat_template_kwargs=body.template_kwargs())


async def chat_completions(state: ServerState, body: ChatCompletionRequest, request: Request):
    engine = _admit(state, body.model, body.n)
    with _reservation(engine, body.n):
        if body.chat_template is not None and not state.args.allow_request_chat_template:
            raise APIError(400, "chat_template in a request is refused by this server (start it with "
                                "--allow-request-chat-template to allow it)", param="chat_template")
        try:
            fns = tools.functions(body.tools)
            mode, names = tools.chosen(body.tool_choice, fns)
        except tools.ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
        fmt = tools.format_for(body.chat_template or state.tokenizer.chat_template,
                               getattr(state.args, "tool_call_parser", None))
        calling = mode != "none" and bool(fns)
        thinking = reasoning.kind_for(body.chat_template or state.tokenizer.chat_template,
                                      getattr(state.args, "reasoning_parser", None))
        tool_text = calling and thinking != "harmony"  # calls written in the tool format (harmony's parser reads its own)
        if thinking == "harmony" and calling and mode != "auto":
            raise APIError(400, "tool_choice must be auto for a model that writes the harmony format (its calls "
                                "are not constrained)", param="tool_choice")
        try:
            tool_spec = tools.constraint(mode, names, fns, body.parallel_tool_calls, fmt) if tool_text else None
        except ValueError as e:
            raise APIError(400, f"the tools' schemas: {e}", param="tools") from None
        try:
            prompt = chat_prompt(state.tokenizer, body, fns, mode, fmt)
        except FieldError as e:
            raise APIError(400, str(e), param=e.param) from None
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # a template error (sandbox violation, bad syntax, raise_exception)
            raise APIError(400, f"the chat template could not be rendered: {e}", param="messages") from None
        ids = await _encode(state, prompt, add_special_tokens=False, param="messages")
        requested = body.max_completion_tokens or body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = _sampling(state, body, _max_tokens(state, requested, len(ids), "messages"), top, body.prompt_logprobs)
        if calling:
            if params.structured_outputs is not None and mode == "required":
                raise APIError(400, "a required tool call and an output format cannot both constrain the output",
                               param="tool_choice")
            if params.structured_outputs is None:
                params = params.clone(structured_outputs=tool_spec)
        params = reasoning.request_params(thinking, params, state.tokenizer)
        if thinking == "think" and params.structured_outputs is not None:  # room to think before the constraint
            try:
                params = params.clone(structured_outputs=reasoning.after_thinking(params.structured_outputs, prompt))
            except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's word on a bad schema
                raise APIError(400, f"invalid output constraint: {e}", param=body.structured()[1] or "tools") from None
        await _compile_constraint(state, params, body.structured()[1] or "tools")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = engine.add(rid, ids, params, prompt, reserved=True)
    created = int(time.time())
    names = state.token_text
    as_ids = body.return_tokens_as_token_ids

    def logprob_entries(c, start: int):
        if not body.logprobs or c.logprobs is None:
            return None
        return {"content": chat_logprobs(names, c.token_ids[start:], c.logprobs[start:], top or 0, as_ids)}

    def chunk(choices, usage=None, extra=None):
        body_ = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                 "choices": choices, **(extra or {})}
        if usage is not None:
            body_["usage"] = usage
        return _sse(body_)

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)

        async def events():
            sent_text: dict[int, str] = {}
            sent_tokens: dict[int, int] = {}
            finished: set[int] = set()
            parsers = {i: reasoning.Reply(reasoning.new_parser(thinking, prompt) if thinking else None,
                                          tools.StreamParser(fmt) if tool_text else None)
                       for i in range(body.n)} if calling or thinking else {}
            pending_from: dict[int, int] = {}  # first token whose logprobs have not gone out (tools)
            final = None
            for i in range(body.n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async for _, out in _watch(request, _merge([stream])):
                usage = _usage_of([out]) if continuous else None
                if final is None and body.prompt_logprobs is not None:
                    yield chunk([], usage, {"prompt_logprobs": prompt_logprobs(names, out.prompt_logprobs)})
                final = out
                for c in out.outputs:
                    prev = sent_text.get(c.index, "")
                    start = sent_tokens.get(c.index, 0)
                    delta = c.text[len(prev):]
                    if delta or len(c.token_ids) > start:
                        sent_text[c.index], sent_tokens[c.index] = c.text, len(c.token_ids)
                        if parsers:
                            lp = logprob_entries(c, pending_from.get(c.index, start))
                            deltas = parsers[c.index].feed(c.text, final=c.finish_reason is not None)
                            if not deltas:  # text held back: its logprobs go with the next piece
                                pending_from.setdefault(c.index, start)
                            for d in deltas:  # a reasoning piece not shown takes its logprobs with it
                                pending_from.pop(c.index, None)
                                if (d := reasoning.shown(d, body.include_reasoning)) is None:
                                    continue
                                yield chunk([{"index": c.index, "delta": d, "logprobs": lp,
                                              "finish_reason": None}], usage)
                                lp = None
                        elif delta or body.logprobs:
                            yield chunk([{"index": c.index, "delta": {"content": delta},
                                          "logprobs": logprob_entries(c, start), "finish_reason": None}], usage)
                    if c.finish_reason is not None and c.index not in finished:
                        finished.add(c.index)
                        reason = c.finish_reason
                        if parsers:
                            for d in parsers[c.index].feed(c.text, final=True):
                                if (d := reasoning.shown(d, body.include_reasoning)) is not None:
                                    yield chunk([{"index": c.index, "delta": d, "logprobs": None,
                                                  "finish_reason": None}], usage)
                            if parsers[c.index].calls:
                                reason = "tool_calls"
                        yield chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                      "finish_reason": reason, "stop_reason": c.stop_reason}], usage)
            if include_usage and final is not None:
                yield chunk([], _usage_of([final]))

        return _streaming(events())

    async def collect():
        async for _, out in _watch(request, _merge([stream])):
            if out.finished:
                return out

    out = await _run(request, collect())

    def message(c) -> tuple[dict, str]:
        if thinking:
            fields = reasoning.parse(reasoning.new_parser(thinking, prompt), c.text)
        else:
            fields = {"content": c.text}
        if tool_text and fields["content"]:
            content, calls = tools.parse(fields["content"], fmt)
            if calls:
                fields.update(content=content, tool_calls=calls)
        msg = {"role": "assistant", **(reasoning.shown(fields, body.include_reasoning) or {})}
        return msg, "tool_calls" if msg.get("tool_calls") else c.finish_reason

    choices = []
    for c in out.outputs:
        msg, reason = message(c)
        choices.append({"index": c.index, "message": msg, "logprobs": logprob_entries(c, 0), "finish_reason": reason,
                        "stop_reason": c.stop_reason})
    response = {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
                "choices": choices, "usage": _usage_of([out])}
    if body.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs(names, out.prompt_logprobs)
    return response


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
        ids = await _encode(state, text, add_special_tokens=False, param="messages")
    else:
        ids = await _encode(state, body.prompt, add_special_tokens=body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": state.ready_engine().engine.max_model_len}


async def detokenize(state: ServerState, body: DetokenizeRequest):
    engine = state.ready_engine()
    vocab = engine.engine.vocab_size
    if any(t < 0 or t >= vocab for t in body.tokens):
        raise APIError(400, f"tokens must be in [0, {vocab})", param="tokens")
    return {"prompt": state.tokenizer.decode(body.tokens)}

