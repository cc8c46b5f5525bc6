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
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped after an internal error; no request can be served."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[list[RequestOutput], float], None] | None = None,
                 log_interval: float = 5.0) -> None:
        self.engine = engine
        self.on_step = on_step
        self.log_interval = log_interval
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._pending_adds = 0  # requests handed over but not yet seen by the engine thread
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="tokenmill-engine", daemon=True)
        self._on_death: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._send(("wake",))
        self._thread.join(timeout)

    def add_death_callback(self, fn: Callable[[], None]) -> None:
        self._on_death.append(fn)

    @property
    def is_dead(self) -> bool:
        return self.error is not None

    @property
    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting + self._pending_adds

    # ------------------------------------------------------------------ requests
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the iteration early (or being cancelled) aborts it."""
        if self.is_dead:
            raise EngineDeadError("the engine has stopped after an internal error")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._count_pending(+1)
        self._send(("add", request_id, prompt, prompt_token_ids, params, time.time()))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def _count_pending(self, delta: int) -> None:
        with self._pending_lock:  # updated from the event loop and the engine thread
            self._pending_adds += delta

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

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
                outputs = engine.step()
                now = time.time()
                sched = engine.last_step
                if sched is not None:
                    for s in sched.scheduled:  # a sampled token's position counts as generation, the rest as prompt
                        tokens_since[0] += s.num_new_tokens - 1 if s.samples else s.num_new_tokens
                    tokens_since[1] += sched.num_generated
                self._deliver(outputs)
                if self.on_step is not None:
                    self.on_step(outputs, now)
                if time.monotonic() - last_log >= self.log_interval:
                    self._log_throughput(time.monotonic() - last_log, tokens_since)
                    last_log, tokens_since = time.monotonic(), [0, 0]
        except BaseException as e:  # the engine is broken: fail every request now, never hang them
            logger.exception("engine loop died")
            self.error = e
            dead = EngineDeadError(f"the engine stopped after an internal error ({type(e).__name__})")
            for stream in list(self._streams.values()):
                stream.put(dead)
            for fn in self._on_death:
                fn()
            self._drain_dead(dead)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams with one wake-up of each event loop, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
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
                self._count_pending(-1)
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
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, ids, params, arrival = cmd
            self._count_pending(-1)
            stream = self._streams.get(rid)
            if stream is None:  # the client left before the engine saw the request
                return
            try:
                self.engine.add_request(rid, prompt, params, arrival_time=arrival, prompt_token_ids=ids)
            except ValueError as e:
                stream.put(e)
        elif kind == "abort":
            for out in self.engine.abort_request(cmd[1]):
                if self.on_step is not None:
                    self.on_step([out], time.time())
        elif kind == "call":
            cmd[1](self.engine)

    def _log_throughput(self, elapsed: float, tokens: list[int]) -> None:
        s = self.engine.stats()
        logger.info("prompt throughput %.1f tok/s, generation throughput %.1f tok/s, running %d, waiting %d, "
                    "KV cache usage %.1f%%", tokens[0] / elapsed, tokens[1] / elapsed, s["num_requests_running"],
                    s["num_requests_waiting"], 100 * s["kv_cache_usage_perc"])
