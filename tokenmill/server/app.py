"""The OpenAI-compatible HTTP server: app, lifecycle, errors, auth, limits."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
import time
from typing import Optional

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill import __version__
from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError, RequestCutOffError
from tokenmill.memory import one_malloc_arena
from tokenmill.server import dashboard
from tokenmill.server.logprobs import TokenText
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                       error_body)

logger = logging.getLogger("tokenmill")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


class ServerState:
    """What the handlers share: the engine once loaded, limits, the served name, metrics."""

    def __init__(self, args, engine_kwargs: dict) -> None:
        self.args = args
        self.engine_kwargs = engine_kwargs
        self.api_key = args.api_key or os.environ.get("TOKENMILL_API_KEY") or None
        self.model_name = args.served_model_name or _default_name(engine_kwargs.get("model"))
        self.metrics = ServerMetrics(self.model_name)
        self.engine: AsyncEngine | None = None
        self.load_error: BaseException | None = None
        self.exit_code = 0
        self.server = None  # the uvicorn.Server, to stop it from inside
        self.draining = False  # set at SIGTERM: new requests get 503, those in flight may finish
        self._token_text: TokenText | None = None
        self.started = time.time()

    # ------------------------------------------------------------------ engine
    def load(self) -> None:
        from tokenmill.config import EngineConfig
        from tokenmill.engine.engine import LLMEngine

        try:
            llm_engine = LLMEngine(EngineConfig(**self.engine_kwargs))
            engine = AsyncEngine(llm_engine, on_step=self.metrics.on_step)
            self.metrics.timeline.stats_source = llm_engine.stats
            engine.add_death_callback(lambda: self.stop(1))
            engine.start()
            self.engine = engine
            logger.info("ready: serving %s at http://%s:%d (ready after %.1f s)", self.model_name, self.args.host,
                        self.args.port, time.time() - self.started)
        except BaseException as e:
            self.load_error = e
            logger.error("could not load the model: %s", e)
            self.stop(1)

    def stop(self, code: int) -> None:
        self.exit_code = code
        if self.server is not None:
            self.server.should_exit = True

    def cut_off(self) -> None:
        """The drain timeout has passed: end the requests still in flight with a shutdown error (a 503
        JSON body, or an SSE error event and [DONE]) rather than let the server cancel their handlers."""
        if self.engine is not None:
            cut = self.engine.cut_off("the server is shutting down; the request was stopped before it finished")
            if cut:
                logger.warning("shutdown timeout (%g s) reached: stopped %d request(s) still in flight",
                               self.args.shutdown_timeout, cut)

    def ready_engine(self) -> AsyncEngine:
        if self.engine is None:
            raise APIError(503, "the model is still loading; retry shortly", "service_unavailable",
                           headers={"Retry-After": "2"})
        if self.engine.is_dead:
            raise APIError(500, "the engine has stopped after an internal error", "server_error")
        return self.engine

    @property
    def tokenizer(self):
        return self.ready_engine().engine.tokenizer

    @property
    def token_text(self) -> TokenText:
        """How the API names tokens and their bytes (made once, with the engine's tokenizer)."""
        tokenizer = self.tokenizer
        if self._token_text is None or self._token_text.tokenizer is not tokenizer:
            self._token_text = TokenText(tokenizer)
        return self._token_text


def _default_name(model: str | None) -> str:
    from tokenmill.model.hub import DEFAULT_MODEL

    if not model:
        return DEFAULT_MODEL
    return os.path.basename(model.rstrip("/")) if os.path.exists(model) else model


# ---------------------------------------------------------------------- body size limit
class BodyLimits:
    """Refuse bodies over the size limit with 413, whether or not they declare their length, and bodies
    that take longer than read_timeout seconds to arrive with 408 (closing the connection), so that slow
    senders cannot hold the server's connections."""

    def __init__(self, app, limit: int, read_timeout: float) -> None:
        self.app, self.limit, self.read_timeout = app, limit, read_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _send_json(send, 413, error_body(
                f"request body of {int(declared)} bytes exceeds the limit of {self.limit}", "invalid_request_error", 413))
        # The whole body is read here, before the app: an exception raised while FastAPI reads it would
        # become a 400 "error parsing the body", and a chunked body declares no length to check first.
        chunks, seen = [], 0
        deadline = asyncio.get_running_loop().time() + self.read_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return await _send_json(send, 408, error_body(
                    f"the request body did not arrive within {self.read_timeout:g} s", "invalid_request_error", 408),
                    close=True)
            if message["type"] != "http.request":  # the client left before it finished sending
                return
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.limit:
                return await _send_json(send, 413, error_body(
                    f"request body exceeds the limit of {self.limit} bytes", "invalid_request_error", 413))
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def _guarded_protocol(state: ServerState, max_connections: int, header_timeout: float):
    """uvicorn's HTTP protocol (httptools where installed, else h11) with two guards for the file
    descriptors: past max_connections, a new connection closes the kept-alive connection idle the longest,
    or, where every connection is busy with a request, gets a 503 and is closed at once; and a connection
    whose first request headers have not arrived within header_timeout seconds gets a 408 and is closed
    (the body has its own timeout in BodyLimits)."""
    try:
        import httptools  # noqa: F401

        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    def refuse(transport, status: int, reason: str, message: str) -> None:
        state.metrics.refused_connections.labels(state.model_name, reason).inc()
        transport.write(_json_response(status, error_body(message, "server_busy" if status == 503 else
                                                          "invalid_request_error", status), close=True))
        transport.close()

    class GuardedProtocol(Base):
        # The header timer runs from a connection's opening, and again from the first bytes of each later
        # request on it, until that request's headers are complete (uvicorn then has a request cycle).
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._headers_timer = None
            if len(self.connections) > max_connections and not self._close_longest_idle():
                refuse(transport, 503, "max_connections",
                       f"too many open connections (at most {max_connections}); retry shortly")
                return
            self._arm()

        def _close_longest_idle(self) -> bool:
            """At the cap, a kept-alive connection waiting for its next request gives way to a new one (its
            client reconnects when it has a request); one that is mid-request never does."""
            idle = [c for c in self.connections if c is not self and c.timeout_keep_alive_task is not None
                    and not c.transport.is_closing()]
            if not idle:
                return False
            longest = min(idle, key=lambda c: c.timeout_keep_alive_task.when())
            longest.timeout_keep_alive_task.cancel()
            longest.timeout_keep_alive_task = None
            longest.transport.close()
            self.connections.discard(longest)
            state.metrics.closed_idle_connections.inc()
            return True

        def data_received(self, data: bytes) -> None:
            if self._headers_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first bytes of a new request on a kept-alive connection
            super().data_received(data)

        def _arm(self) -> None:
            self._armed_cycle = self.cycle
            self._headers_timer = self.loop.call_later(header_timeout, self._headers_overdue)

        def _headers_overdue(self) -> None:
            self._headers_timer = None
            if self.cycle is self._armed_cycle and not self.transport.is_closing():  # no new request began
                refuse(self.transport, 408, "header_timeout",
                       f"the request headers did not arrive within {header_timeout:g} s")

        def connection_lost(self, exc) -> None:
            if self._headers_timer is not None:
                self._headers_timer.cancel()
                self._headers_timer = None
            super().connection_lost(exc)

    return GuardedProtocol


def _json_parts(body: dict, close: bool) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """A JSON error body and its headers, for answers given below FastAPI."""
    import json

    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    return data, headers


def _json_response(status: int, body: dict, close: bool) -> bytes:
    """A whole HTTP/1.1 response, for the transport-level guards."""
    from http import HTTPStatus

    data, headers = _json_parts(body, close)
    head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()
    return head + b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"\r\n" + data


async def _send_json(send, status: int, body: dict, close: bool = False) -> None:
    data, headers = _json_parts(body, close)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


# ---------------------------------------------------------------------- the app
def check_api_key(request: Request, api_key: str | None) -> None:
    """Raises a 401 APIError unless the request carries `Authorization: Bearer <api_key>` (None: no key set)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    given = header[7:] if header.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(given.encode(), api_key.encode()):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", "authentication_error")


def build_app(state: ServerState) -> FastAPI:
    from contextlib import asynccontextmanager

    from tokenmill.server import openai_routes

    @asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=state.load, name="tokenmill-load", daemon=True).start()
        yield
        if state.engine is not None:
            for rid in list(state.engine._streams):
                state.engine.abort(rid)
            state.engine.shutdown()

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible LLM inference server")
    app.state.tm = state

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(error_body(exc.message, exc.type, exc.status, exc.param), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":  # its loc is a character position, not a field
            where = first.get("loc", ("body", "?"))[-1]
            reason = (first.get("ctx") or {}).get("error", "invalid JSON")
            return JSONResponse(error_body(f"the request body is not valid JSON: {reason} at character {where}",
                                           "invalid_request_error", 400), 400)
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid request body")
        return JSONResponse(error_body(message, "invalid_request_error", 400, loc or None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return JSONResponse(error_body(str(exc.detail), kind, exc.status_code), exc.status_code)

    @app.exception_handler(RequestCutOffError)
    async def _cut_off(request, exc):  # a request added after the shutdown cut-off
        return JSONResponse(error_body(str(exc), "server_shutdown", 503), 503)

    @app.exception_handler(EngineDeadError)
    async def _dead(request, exc):
        return JSONResponse(error_body(str(exc), "server_error", 500), 500)

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        logger.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body("internal server error", "server_error", 500), 500)

    async def require_key(request: Request) -> None:
        check_api_key(request, state.api_key)

    guarded = [Depends(require_key)]

    @app.get("/health")
    async def health():
        if state.engine is None or state.engine.is_dead:
            return JSONResponse({"status": "loading" if state.engine is None else "dead"}, 503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        if state.engine is not None:
            state.metrics.refresh(state.engine.engine.stats())
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page():
        # The page holds no data; what it shows comes from /dashboard/stats, which the API key guards.
        return HTMLResponse(dashboard.page(), headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/stats", dependencies=guarded)
    async def dashboard_stats(since: Optional[int] = None):
        snap = state.metrics.timeline.snapshot(since)
        engine = state.engine.engine if state.engine is not None else None
        snap["model"] = state.model_name
        snap["status"] = "loading" if state.engine is None else ("dead" if state.engine.is_dead else "ok")
        snap["started"] = state.started
        snap["sampling_defaults"] = engine.sampling_defaults.describe() if engine is not None else None
        snap["max_num_seqs"] = engine.config.max_num_seqs if engine is not None else None
        snap["kv_cache_blocks"] = engine.num_blocks if engine is not None else None
        snap["speculative"] = None  # acceptance rates, once speculative decoding runs
        return snap

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        max_len = state.engine.engine.max_model_len if state.engine else None
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(state.started),
                                            "owned_by": "tokenmill", "root": state.model_name,
                                            "max_model_len": max_len}]}

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, request: Request):
        return await openai_routes.completions(state, body, request)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await openai_routes.chat_completions(state, body, request)

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(body: TokenizeRequest):
        return await openai_routes.tokenize(state, body)

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(body: DetokenizeRequest):
        return await openai_routes.detokenize(state, body)

    @app.get("/tokenizer_info", dependencies=guarded)
    async def tokenizer_info():
        return tokenizer_info_body(state.tokenizer, state.ready_engine().engine.max_model_len)

    @app.post("/reset_prefix_cache", dependencies=guarded)
    async def reset_prefix_cache():
        state.ready_engine().call(lambda e: e.reset_prefix_cache())
        return {"status": "ok"}

    return app


_TOKENIZER_INFO_DROPPED = {"vocab_file", "merges_file", "tokenizer_file", "tokenizer_object", "name_or_path"}
_SKIP = object()


def tokenizer_info_body(tokenizer, max_model_len: int) -> dict:
    """vLLM's GET /tokenizer_info: the tokenizer's configuration as tokenizer_config.json would hold it.

    Its constructor arguments that survive JSON (special tokens as their text, no file paths), then the
    fields clients read (lm-eval's remote tokenizer reads eos_token, bos_token, pad_token and
    chat_template) taken from the live tokenizer, so that a tokenizer built from a GGUF answers the same
    way as one read from a folder. model_max_length is the server's context limit.
    """
    def plain(value):
        if hasattr(value, "content"):  # tokenizers' AddedToken
            return value.content
        if value is None or isinstance(value, (str, bool, int, float)):
            return value
        if isinstance(value, dict):
            items = ((k, plain(v)) for k, v in value.items() if isinstance(k, str))
            return {k: v for k, v in items if v is not _SKIP}
        if isinstance(value, (list, tuple)):
            return [v for v in map(plain, value) if v is not _SKIP]
        return _SKIP  # anything else (a tokenizer object, a path object) is left out

    info = {}
    for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items():
        if key in _TOKENIZER_INFO_DROPPED:
            continue
        value = plain(value)
        if value is not _SKIP:
            info[key] = value
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(tokenizer, name, None)
    info["tokenizer_class"] = type(tokenizer).__name__
    info["model_max_length"] = max_model_len
    template = getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    else:
        info.pop("chat_template", None)
    return info


_CUT_OFF_GRACE_S = 5.0  # after the cut-off, for the cut requests' error responses to go out


def _graceful_server_class():
    import contextlib
    import signal

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """A shutdown that drains: at SIGTERM new requests get 503 and those in flight may finish for
        --shutdown-timeout seconds; then they end with a shutdown error in their own response shape.
        uvicorn cancels whatever is left _CUT_OFF_GRACE_S later. uvicorn re-raises SIGTERM after its
        graceful shutdown (so the process dies of it); we exit 0 instead."""

        def __init__(self, config, state: ServerState) -> None:
            super().__init__(config)
            self.state = state

        async def shutdown(self, sockets=None) -> None:
            self.state.draining = True
            timer = asyncio.get_running_loop().call_later(self.state.args.shutdown_timeout, self.state.cut_off)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GracefulServer


def _raise_open_files_limit(connections: int) -> None:
    """Lift the soft limit on open files towards the hard one, so that --max-connections, not the
    process's file limit, is what refuses connections."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + 256  # model files, the tokenizer, logs, the engine's own
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError):
            new = soft
        if new < wanted:
            logger.warning("open files are limited to %d: fewer than --max-connections %d can be held", new,
                           connections)


def make_server(app, state, args):
    """The uvicorn server for `app` under the serve flags' limits (body size and read timeout, the
    connection cap and header timeout, the drain and cut-off at shutdown); also state.server."""
    import uvicorn

    config = uvicorn.Config(BodyLimits(app, args.max_body_bytes, args.body_read_timeout), host=args.host,
                            port=args.port, log_level=args.log_level.lower(),
                            http=_guarded_protocol(state, args.max_connections, args.body_read_timeout),
                            timeout_keep_alive=args.keep_alive_timeout,
                            timeout_graceful_shutdown=int(args.shutdown_timeout + _CUT_OFF_GRACE_S + 0.999),
                            access_log=False)
    _raise_open_files_limit(args.max_connections)
    state.server = _graceful_server_class()(config, state)
    return state.server


def run_server(args) -> int:
    """Run `tokenmill serve` until SIGTERM / Ctrl-C (exit 0) or an engine failure (exit 1)."""
    one_malloc_arena()  # before the server's threads start: see tokenmill.memory
    if getattr(args, "data_parallel_size", 1) > 1:
        from tokenmill.server.data_parallel import run_front

        return run_front(args)
    if getattr(args, "data_parallel_size", 1) < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")

    from tokenmill.cli import engine_kwargs
    from tokenmill.llm import _configure_logging

    _configure_logging()
    logging.getLogger("tokenmill").setLevel(args.log_level.upper())
    state = ServerState(args, engine_kwargs(args))
    server = make_server(build_app(state), state, args)
    logger.info("tokenmill %s listening on http://%s:%d (model loading)", __version__, args.host, args.port)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if state.load_error is not None:
        return 1
    return state.exit_code

