"""AsyncEngine: the engine steps in its own thread; asyncio callers get per-request output streams.

Torch releases the GIL inside its kernels, so the HTTP event loop stays responsive while a step runs.
Requests and aborts reach the engine thread through a queue and are applied between steps.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from tokenmill.engine.engine import LLMEngine
from tokenmill.memory import release_freed_heap
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("tokenmill")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped after an internal error; no request can be served."""


class RequestFailedError(RuntimeError):
    """This request failed alone (the engine and the other requests go on)."""


class RequestCutOffError(RequestFailedError):
    """The server stopped this request before it finished (shutdown after the drain timeout)."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    final_only: bool = False  # its reader wants the final output alone

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)


class RequestStream:
    """A request's outputs as the engine produces them (async iteration); closing it before the request
    has finished aborts the request."""

    def __init__(self, engine: "AsyncEngine", request_id: str, stream: _Stream) -> None:
        self._engine, self.request_id, self._stream = engine, request_id, stream
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._stream.queue.get()
        except BaseException:  # cancelled while waiting: nobody will read the rest
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            await self.aclose()
            raise item
        if item.finished:
            self._done = True
            self._engine._streams.pop(self.request_id, None)
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._engine._streams.pop(self.request_id, None)
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[list[RequestOutput], float], None] | None = None,
                 log_interval: float = 5.0, trim_interval: float = 10.0) -> None:
        self.engine = engine
        self.on_step = on_step
        self.log_interval = log_interval
        # While steps run, freed heap pages go back to the OS at most this often (tokenmill.memory).
        self.trim_interval = trim_interval
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._pending_adds = 0  # sequences (prompts x n) reserved or handed over, not yet seen by the engine thread
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="tokenmill-engine", daemon=True)
        self._on_death: list[Callable[[], None]] = []
        self._cut_off: str | None = None  # cut_off()'s message, once called

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._send(("wake",))
        self._thread.join(timeout)
        self.engine.shutdown()

    def add_death_callback(self, fn: Callable[[], None]) -> None:
        self._on_death.append(fn)

    @property
    def is_dead(self) -> bool:
        return self.error is not None

    @property
    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting + self._pending_adds

    # ------------------------------------------------------------------ requests
    def try_reserve(self, sequences: int, limit: int) -> bool:
        """Hold places for `sequences` waiting sequences if the queue stays within limit (the caller then
        passes them on with add() or gives them back with release()). Exact under any concurrency."""
        with self._pending_lock:
            if self.engine.scheduler.num_waiting + self._pending_adds + sequences > limit:
                return False
            self._pending_adds += sequences
            return True

    def release(self, sequences: int) -> None:
        """Give back places held by try_reserve() that will not be used."""
        self._count_pending(-sequences)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
            reserved: bool = False) -> RequestStream:
        """Queue a request now; its outputs arrive on the returned stream. `reserved`: its places in the
        queue were taken by try_reserve()."""
        if self.is_dead:
            raise EngineDeadError("the engine has stopped after an internal error")
        if self._cut_off is not None:  # a reservation is the caller's to release
            raise RequestCutOffError(self._cut_off)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(),
                         params.output_kind is RequestOutputKind.FINAL_ONLY)
        self._streams[request_id] = stream
        if not reserved:
            self._count_pending(params.n)
        self._send(("add", request_id, prompt, prompt_token_ids, params, time.time()))
        return RequestStream(self, request_id, stream)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the iteration early (or being cancelled) aborts it."""
        stream = self.add(request_id, prompt_token_ids, params, prompt)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def _count_pending(self, delta: int) -> None:
        with self._pending_lock:  # updated from the event loop and the engine thread
            self._pending_adds += delta

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def cut_off(self, message: str) -> int:
        """End every request still in flight: each reader gets RequestCutOffError(message) and the engine
        drops the request; requests added later fail at once the same way. Returns how many were cut."""
        self._cut_off = message  # and any request added from now on fails at once
        streams = list(self._streams.items())
        for request_id, stream in streams:
            stream.put(RequestCutOffError(message))
            self.abort(request_id)
        return len(streams)

    def call(self, fn: Callable[[LLMEngine], object]) -> None:
        """Run fn(engine) on the engine thread between steps."""
        self._send(("call", fn))

    def _send(self, cmd: tuple) -> None:
        """Queue a command for the engine thread, cutting short a burst of decode steps it may be running."""
        self._commands.put(cmd)
        self.engine.interrupt()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        engine = self.engine
        last_log, tokens_since = time.monotonic(), [0, 0]
        next_trim = time.monotonic() + self.trim_interval
        # Test hook: make the loop fail after N steps, to exercise the server's handling of a dead engine.
        fail_after = int(os.environ.get("TOKENMILL_INJECT_ENGINE_FAILURE_AFTER_STEPS", "0"))
        steps = 0
        try:
            while not self._stop.is_set():
                engine.clear_interrupt()  # before taking the commands: one queued after this interrupts again
                self._apply_commands(block=not engine.has_unfinished_requests())
                if not engine.has_unfinished_requests():
                    continue
                steps += 1
                if fail_after and steps > fail_after:
                    raise RuntimeError("injected engine failure")
                engine.step(emit=self._emit)
                sched = engine.last_step
                if sched is not None:
                    for s in sched.scheduled:  # a sampled token's position counts as generation, the rest as prompt
                        tokens_since[0] += s.num_new_tokens - 1 if s.samples else s.num_new_tokens
                    tokens_since[1] += sched.num_generated
                if time.monotonic() - last_log >= self.log_interval:
                    self._log_throughput(time.monotonic() - last_log, tokens_since)
                    last_log, tokens_since = time.monotonic(), [0, 0]
                if time.monotonic() >= next_trim:
                    release_freed_heap()  # ~3 ms (at most 12 seen) on the default model under load
                    next_trim = time.monotonic() + self.trim_interval
        except BaseException as e:  # the engine is broken: fail every request now, never hang them
            logger.exception("engine loop died")
            self.error = e
            dead = EngineDeadError(f"the engine stopped after an internal error ({type(e).__name__})")
            for stream in list(self._streams.values()):
                stream.put(dead)
            for fn in self._on_death:
                fn()
            self._drain_dead(dead)

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs (each step of a burst as soon as it is done): to their streams and the metrics."""
        self._deliver(outputs)
        self._emit_stats(outputs)

    def _emit_stats(self, outputs: list[RequestOutput]) -> None:
        if self.on_step is not None and outputs:
            try:
                self.on_step(outputs, time.time())
            except Exception:  # statistics must never stop the engine
                logger.exception("metrics update failed")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams with one wake-up of each event loop, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None and (out.finished or not stream.final_only):
                item = RequestFailedError(out.error) if out.error is not None else out
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _drain_dead(self, dead: EngineDeadError) -> None:
        """Requests that arrive after death are failed as soon as they are queued."""
        while not self._stop.is_set():
            try:
                cmd = self._commands.get(timeout=0.1)
            except queue.Empty:
                continue
            if cmd[0] == "add":
                self._count_pending(-cmd[4].n)
                stream = self._streams.get(cmd[1])
                if stream is not None:
                    stream.put(dead)

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd) -> None:
        """One command from the event loop. A failure here concerns that request or call alone: it is
        reported to its stream (or logged) and the engine goes on."""
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, ids, params, arrival = cmd
            stream = self._streams.get(rid)
            try:
                if stream is not None:  # else the client left before the engine saw the request
                    self.engine.add_request(rid, prompt, params, arrival_time=arrival, prompt_token_ids=ids)
            except ValueError as e:
                stream.put(e)
            except Exception as e:
                logger.exception("could not add request %s", rid)
                self.engine.abort_request(rid)
                stream.put(RequestFailedError(f"the request could not be started ({type(e).__name__}: {e})"))
            finally:  # only now: until the scheduler counts them, these places stay taken
                self._count_pending(-params.n)
        elif kind == "abort":
            self._emit_stats(self.engine.abort_request(cmd[1]))
        elif kind == "call":
            try:
                cmd[1](self.engine)
            except Exception:
                logger.exception("engine call failed")

    def _log_throughput(self, elapsed: float, tokens: list[int]) -> None:
        s = self.engine.stats()
        spec = f", {self.engine.spec_stats.describe()}" if "spec_decode_num_drafts" in s else ""
        logger.info("prompt throughput %.1f tok/s, generation throughput %.1f tok/s, running %d, waiting %d, "
                    "KV cache usage %.1f%%%s", tokens[0] / elapsed, tokens[1] / elapsed, s["num_requests_running"],
                    s["num_requests_waiting"], 100 * s["kv_cache_usage_perc"], spec)
