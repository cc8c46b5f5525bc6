"""`tokenmill serve --data-parallel-size N`: one HTTP front before N replicas, each a `tokenmill serve` child
with its own engine and KV cache.

The front tokenizes each generation request as the replicas will, routes it (router.py) and relays the
replica's answer byte for byte, streams included, so every endpoint keeps its semantics. A client that leaves
closes the front's connection to the replica, which aborts the request there. A replica that dies fails the
requests it held with a 503 (a stream gets an SSE error event and [DONE]) and is restarted (replicas.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import threading

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from tokenmill import __version__
from tokenmill.server.app import APIError, _default_name, check_api_key
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from tokenmill.server.replicas import Replica, ReplicaSet
from tokenmill.server.router import make_router, prefix_block_hashes

logger = logging.getLogger("tokenmill")

_DISCONNECT_POLL_S = 0.25
_OPEN_PATHS = ("/health", "/version", "/metrics", "/dashboard")  # as the single server has them  # answered without the API key
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server"}


class FrontMetrics:
    """The front's own counters, each labelled by replica; the replicas' metrics are appended at scrape time."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        per_replica = ["model_name", "replica"]
        self.routed = Counter("tokenmill:router_requests", "Generation requests routed to the replica.",
                              per_replica, registry=r)
        self.query_blocks = Counter("tokenmill:router_prefix_query_blocks", "Full prompt blocks of routed "
                                    "requests.", ["model_name"], registry=r).labels(model_name)
        self.hit_blocks = Counter("tokenmill:router_prefix_hit_blocks", "Leading prompt blocks the chosen "
                                  "replica was believed to hold (the router's estimate).", ["model_name"],
                                  registry=r).labels(model_name)
        self.up = Gauge("tokenmill:replica_up", "1 while the replica is ready to serve.", per_replica, registry=r)
        self.in_flight = Gauge("tokenmill:replica_requests_in_flight", "Requests sent to the replica and not "
                               "finished.", per_replica, registry=r)
        self.restarts = Counter("tokenmill:replica_restarts", "Times the replica was started again after it "
                                "died.", per_replica, registry=r)
        self.failed = Counter("tokenmill:replica_failed_requests", "Requests that failed because their replica "
                              "stopped.", per_replica, registry=r)
        # What app._guarded_protocol counts its refusals in (named apart from the replicas' own, which the
        # front's /metrics holds too: a family may appear once).
        self.refused_connections = Counter("tokenmill:front_connections_refused", "Connections refused by the "
                                           "front at --max-connections, or closed because their request headers "
                                           "did not arrive in time.", ["model_name", "reason"], registry=r)
        self.closed_idle_connections = Counter("tokenmill:front_connections_closed_idle", "Kept-alive connections, "
                                               "idle between requests, closed by the front at --max-connections "
                                               "to admit a new one.", ["model_name"], registry=r).labels(model_name)

    def label(self, metric, replica: int):
        return metric.labels(self.model_name, str(replica))


class FrontState:
    """What the front's handlers share: replicas, router, tokenizer (for routing), HTTP client, metrics."""

    def __init__(self, args, model_path: str) -> None:
        from tokenmill.kernels.cpu import usable_cpus

        n = args.data_parallel_size
        self.args, self.model_path = args, model_path
        self.model_name = args.served_model_name or _default_name(args.model)
        self.api_key = args.api_key or os.environ.get("TOKENMILL_API_KEY") or None
        self.secret = secrets.token_urlsafe(24)  # the replicas' key: only the front talks to them
        self.metrics = FrontMetrics(self.model_name)
        self.router = make_router(args.router, n)
        self.threads = max(1, usable_cpus() // n)
        self.replicas = ReplicaSet(args, n, self.threads, self.secret, self._ready, self._died, self._started)
        self.tokenizer = None  # loaded in the background; until then requests are routed by load alone
        self.client: httpx.AsyncClient | None = None
        self.draining = False
        self.server = None

    def _ready(self, r: Replica) -> None:
        if r.kv_cache_blocks:
            self.router.set_capacity(r.index, r.kv_cache_blocks)
        self.metrics.label(self.metrics.up, r.index).set(1)

    def _died(self, r: Replica) -> None:
        self.router.forget(r.index)  # a restarted replica starts with an empty cache
        self.metrics.label(self.metrics.up, r.index).set(0)
        if all(x.status == "removed" for x in self.replicas) and self.server is not None:
            logger.error("every replica has been removed: stopping")
            self.server.should_exit = True

    def _started(self, r: Replica) -> None:
        if r.restarts:
            self.metrics.label(self.metrics.restarts, r.index).inc()

    def load_tokenizer(self) -> None:
        from tokenmill.model.loader import load_tokenizer

        try:
            self.tokenizer = load_tokenizer(self.model_path)
        except Exception as e:  # routing by load still works
            logger.warning("the front could not load the tokenizer (%s): requests are routed by load alone", e)

    def cut_off(self) -> None:
        """The drain timeout has passed: the replicas stop their requests (each ends with a shutdown error)."""
        self.replicas.terminate()

    # ------------------------------------------------------------------ routing
    def prompt_hashes(self, path: str, body: bytes) -> list[bytes]:
        """The chained block hashes of the request's (first) prompt, rendered and tokenized as a replica
        will; [] when it cannot be worked out here (the replica answers the error)."""
        tok = self.tokenizer
        if tok is None:
            return []
        try:
            if path.endswith("/chat/completions"):
                req = ChatCompletionRequest.model_validate_json(body)
                if req.chat_template is not None and not self.args.allow_request_chat_template:
                    return []
                from tokenmill.server import tools
                from tokenmill.server.openai_routes import chat_prompt

                fns = tools.functions(req.tools)
                mode, _ = tools.chosen(req.tool_choice, fns)
                fmt = tools.format_for(req.chat_template or tok.chat_template, self.args.tool_call_parser)
                ids = tok.encode(chat_prompt(tok, req, fns, mode, fmt), add_special_tokens=False)
            else:
                req = CompletionRequest.model_validate_json(body)
                prompt = req.prompt
                if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                    prompt = prompt[0]
                ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        except Exception:
            return []
        return prefix_block_hashes(ids, self.args.block_size, getattr(req, "cache_salt", None))

    def pick(self, hashes: list[bytes], exclude: set[int] = frozenset()) -> Replica:
        available = [r.ready and r.index not in exclude for r in self.replicas]
        try:
            i = self.router.choose(hashes, [r.in_flight for r in self.replicas], available)
        except LookupError:
            raise _no_replica() from None
        self.metrics.query_blocks.inc(len(hashes))
        self.metrics.hit_blocks.inc(self.router.score(i, hashes))
        self.router.record(i, hashes)
        self.metrics.label(self.metrics.routed, i).inc()
        return self.replicas[i]

    def any_ready(self, exclude: set[int] = frozenset()) -> Replica:
        ready = [r for r in self.replicas if r.ready and r.index not in exclude]
        if not ready:
            raise _no_replica()
        return min(ready, key=lambda r: (r.in_flight, r.index))


# ---------------------------------------------------------------------- relaying
def _no_replica() -> APIError:
    return APIError(503, "no replica is ready to serve; retry shortly", "service_unavailable",
                    headers={"Retry-After": "2"})


async def _until_disconnect(request: Request, coro):
    """Await coro, cancelling it (None) if the client leaves first: a whole answer is sent only at its end,
    so only the connection tells that nobody waits for it."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def _replica_error(r: Replica) -> dict:
    return error_body(f"replica {r.index} stopped while serving this request; retry it", "service_unavailable", 503)


def _sse(obj) -> bytes:
    import json

    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


async def relay(state: FrontState, request: Request, replica: Replica, body: bytes, retry: bool = True,
                hashes: list[bytes] | None = None):
    """Send the request to the replica and answer with its response, relayed as it comes."""
    client = state.client
    url = replica.url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
    headers = {"authorization": f"Bearer {state.secret}",
               "content-type": request.headers.get("content-type", "application/json")}
    upstream = client.build_request(request.method, url, content=body, headers=headers)
    replica.in_flight += 1
    state.metrics.label(state.metrics.in_flight, replica.index).inc()
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            replica.in_flight -= 1
            state.metrics.label(state.metrics.in_flight, replica.index).dec()

    try:
        resp = await _until_disconnect(request, client.send(upstream, stream=True))
    except httpx.ConnectError:
        release()
        # The replica took nothing: it died before the front noticed. Another one may serve the request.
        if retry:
            again = state.pick(hashes, {replica.index}) if hashes is not None else state.any_ready({replica.index})
            return await relay(state, request, again, body, False, hashes)
        state.metrics.label(state.metrics.failed, replica.index).inc()
        return JSONResponse(_replica_error(replica), 503)
    except httpx.HTTPError:
        release()
        state.metrics.label(state.metrics.failed, replica.index).inc()
        return JSONResponse(_replica_error(replica), 503)
    except BaseException:
        release()
        raise
    if resp is None:  # the client left; closing the connection aborted the request at the replica
        release()
        return Response(status_code=499)

    sse = resp.headers.get("content-type", "").startswith("text/event-stream")

    async def chunks():
        pending = b""
        try:
            async for chunk in resp.aiter_raw():
                if not sse:
                    yield chunk
                    continue
                # Whole events only, so that an error event never lands in the middle of a cut one.
                pending += chunk
                end = pending.rfind(b"\n\n")
                if end >= 0:
                    yield pending[:end + 2]
                    pending = pending[end + 2:]
            if pending:
                yield pending
        except httpx.HTTPError:
            state.metrics.label(state.metrics.failed, replica.index).inc()
            if sse:
                yield _sse(_replica_error(replica))
                yield b"data: [DONE]\n\n"
        finally:
            release()
            await resp.aclose()

    headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
    headers["x-tokenmill-replica"] = str(replica.index)
    return StreamingResponse(chunks(), status_code=resp.status_code, headers=headers)


# ---------------------------------------------------------------------- metrics
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?( .*)$")


def merge_metrics(texts: dict[int, str]) -> str:
    """The replicas' Prometheus texts as one, each sample labelled replica="i", each family stated once."""
    heads: dict[str, list[str]] = {}  # family -> its HELP and TYPE lines
    samples: dict[str, list[str]] = {}
    for replica, text in texts.items():
        family = None
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split(" ", 3)[2]
                head = heads.setdefault(family, [])
                if len(head) < 2 and line not in head:
                    head.append(line)
                samples.setdefault(family, [])
                continue
            m = _SAMPLE.match(line)
            if m is None or family is None:
                continue
            name, labels, rest = m.groups()
            inner = labels[1:-1] + "," if labels and labels != "{}" else ""
            samples[family].append(f'{name}{{{inner}replica="{replica}"}}{rest}')
    return "".join(line + "\n" for family in heads for line in heads[family] + samples[family])


# ---------------------------------------------------------------------- the app
def build_front_app(state: FrontState) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        state.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=5.0))
        threading.Thread(target=state.load_tokenizer, name="tokenmill-tokenizer", daemon=True).start()
        state.replicas.start()
        watcher = asyncio.ensure_future(state.replicas.watch(state.client))
        try:
            yield
        finally:
            state.replicas.stopping = True
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await watcher
            await asyncio.get_running_loop().run_in_executor(None, state.replicas.stop)
            await state.client.aclose()

    # The API's description and its docs page come from a replica, through the catch-all route.
    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(error_body(exc.message, exc.type, exc.status, exc.param), exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        logger.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body("internal server error", "server_error", 500), 500)

    def require_key(request: Request) -> None:
        if request.url.path not in _OPEN_PATHS:
            check_api_key(request, state.api_key)

    @app.get("/health")
    async def health():
        replicas = [r.describe() for r in state.replicas]
        if any(r.ready for r in state.replicas):
            return {"status": "ok", "replicas": replicas}
        starting = any(r.status in ("starting", "dead") for r in state.replicas)
        return JSONResponse({"status": "loading" if starting else "dead", "replicas": replicas}, 503)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        async def scrape(r: Replica):
            try:
                return r.index, (await state.client.get(r.url + "/metrics", timeout=5.0)).text
            except httpx.HTTPError:
                return r.index, ""

        texts = dict(await asyncio.gather(*(scrape(r) for r in state.replicas if r.ready)))
        body = merge_metrics(texts).encode() + generate_latest(state.metrics.registry)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def routed(request: Request):
        require_key(request)
        if state.draining:
            raise APIError(503, "the server is shutting down", "server_shutdown")
        body = await request.body()
        hashes = await asyncio.get_running_loop().run_in_executor(
            None, state.prompt_hashes, request.url.path, body)
        return await relay(state, request, state.pick(hashes), body, hashes=hashes)

    app.post("/v1/completions")(routed)
    app.post("/v1/chat/completions")(routed)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        require_key(request)
        for r in state.replicas:
            if r.ready:
                with contextlib.suppress(httpx.HTTPError):  # a replica that just died has no cache to reset
                    await state.client.post(r.url + "/reset_prefix_cache",
                                            headers={"authorization": f"Bearer {state.secret}"})
            state.router.forget(r.index)
        return {"status": "ok"}

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def anything_else(request: Request, path: str):
        """Every other endpoint (models, tokenizer, dashboard) is answered by one ready replica."""
        require_key(request)
        return await relay(state, request, state.any_ready(), await request.body())

    return app


def run_front(args) -> int:
    """Run the front and its replicas until SIGTERM / Ctrl-C; exit 0, or 1 if no replica ever became ready."""
    from tokenmill.llm import _configure_logging
    from tokenmill.model.hub import resolve_model_path
    from tokenmill.server.app import make_server
    from tokenmill.server.router import ROUTERS

    _configure_logging()
    logging.getLogger("tokenmill").setLevel(args.log_level.upper())
    if args.router not in ROUTERS:
        raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {args.router!r}")
    args.ray_model = args.model  # on Ray, each node resolves (or fetches) the model itself
    model_path = resolve_model_path(args.model)  # fetched once here, not by every replica at once
    if args.distributed_executor_backend == "ray":
        from tokenmill.server import ray_replicas

        ray_replicas.connect(args.ray_address)
    state = FrontState(args, model_path)
    args.model, args.served_model_name = model_path, state.model_name  # what the replicas load and answer to
    server = make_server(build_front_app(state), state, args)
    logger.info("tokenmill %s listening on http://%s:%d: %d replicas (%d thread(s) each), %s router",
                __version__, args.host, args.port, args.data_parallel_size, state.threads, args.router)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        state.replicas.stop()
        if args.distributed_executor_backend == "ray":
            from tokenmill.server import ray_replicas

            ray_replicas.disconnect()
    return 1 if all(r.status == "removed" for r in state.replicas) else 0
