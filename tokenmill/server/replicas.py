"""The data-parallel replicas: `tokenmill serve` children on 127.0.0.1, each with its own engine and KV cache,
started, watched, restarted after a crash (with a back-off) and always stopped with the front. (Or on the
nodes of a Ray cluster: ray_replicas.py.)

A child runs in a session of its own, so a Ctrl-C at the terminal reaches the front alone, which then drains
and stops the children in order; and it asks the kernel to kill it when the front dies (PR_SET_PDEATHSIG),
so that not even a SIGKILL of the front leaves an orphan behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from tokenmill.distributed.process import die_with_parent

logger = logging.getLogger("tokenmill")

MAX_FAILED_STARTS = 3  # a replica that dies this many times in a row before it is ready is removed
RESTART_BACKOFF_S = (1.0, 2.0, 4.0)  # by deaths before ready in a row
_WATCH_INTERVAL_S = 0.2


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class Replica:
    index: int
    status: str = "starting"  # starting | ready | dead (restart pending) | removed | stopped
    proc: subprocess.Popen | None = None  # or a ray_replicas.RayProcess
    host: str = "127.0.0.1"
    port: int = 0
    in_flight: int = 0  # requests the front has sent and not finished: the replica's running + waiting
    restarts: int = 0
    failed_starts: int = 0  # deaths before ready, in a row
    restart_at: float = 0.0
    kv_cache_blocks: int | None = None
    started: float = field(default_factory=time.monotonic)
    last_answer: float = 0.0  # when it last answered a health probe (monotonic), once ready
    last_probe: float = 0.0
    probing: bool = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def describe(self) -> dict:
        return {"replica": self.index, "status": self.status, "pid": self.pid, "host": self.host, "port": self.port,
                "in_flight": self.in_flight, "restarts": self.restarts}


class ReplicaSet:
    """Starts N children from the front's arguments and keeps them running until stop()."""

    def __init__(self, args: argparse.Namespace, num_replicas: int, threads: int, secret: str,
                 on_ready=None, on_death=None, on_start=None) -> None:
        self.args, self.threads, self.secret = args, threads, secret
        self.replicas = [Replica(i) for i in range(num_replicas)]
        self.on_ready = on_ready or (lambda replica: None)
        self.on_death = on_death or (lambda replica: None)
        self.on_start = on_start or (lambda replica: None)
        self.stopping = False
        # A ready replica that answers no health probe for this long (alive, but stopped or deadlocked) is
        # killed, and so fails its requests and restarts as a crashed one does.
        self.hang_timeout = float(getattr(args, "replica_hang_timeout", 60.0) or 0.0)
        self.ray = getattr(args, "distributed_executor_backend", "mp") == "ray"
        self._probes: set[asyncio.Task] = set()  # held, so that the loop does not drop a running probe

    def __getitem__(self, i: int) -> Replica:
        return self.replicas[i]

    def __iter__(self):
        return iter(self.replicas)

    def __len__(self) -> int:
        return len(self.replicas)

    # ------------------------------------------------------------------ processes
    def child_args(self, port: int) -> dict:
        """The child's `serve` arguments: the front's, on a private port, with the shared secret as its key."""
        skip = {"func", "data_parallel_size", "router", "api_key", "replica_hang_timeout",
                "distributed_executor_backend", "ray_address", "ray_model"}
        child = {k: v for k, v in vars(self.args).items() if k not in skip}
        child.update(host="127.0.0.1", port=port, data_parallel_size=1, parent_pid=os.getpid(),
                     # The front decides when to cut requests off at shutdown; a child then stops at once.
                     shutdown_timeout=0.0)
        return child

    def spawn(self, replica: Replica) -> None:
        if self.ray:
            return self._spawn_on_ray(replica)
        replica.port = free_port()
        env = {**os.environ, "TOKENMILL_API_KEY": self.secret, "OMP_NUM_THREADS": str(self.threads)}
        cmd = [sys.executable, "-c", "from tokenmill.server.replicas import child_main; child_main()",
               json.dumps(self.child_args(replica.port))]
        # Popen on the event loop's thread (the main one): PR_SET_PDEATHSIG fires when the creating thread ends.
        replica.proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        replica.status, replica.started, replica.kv_cache_blocks = "starting", time.monotonic(), None
        logger.info("replica %d: started (pid %d, port %d, %d thread(s))", replica.index, replica.pid,
                    replica.port, self.threads)
        self.on_start(replica)

    def _spawn_on_ray(self, replica: Replica) -> None:
        from tokenmill.server.ray_replicas import RayProcess

        if replica.proc is not None:
            replica.proc.release()
        args = self.child_args(0)
        args["model"] = getattr(self.args, "ray_model", None) or args["model"]  # as each node resolves it
        env = {"TOKENMILL_API_KEY": self.secret, "OMP_NUM_THREADS": str(self.threads)}
        try:
            replica.proc = RayProcess(self.threads, args, env)
        except Exception as e:  # no node can take it now: a death before ready, retried with the back-off
            logger.error("replica %d: Ray could not start it (%s)", replica.index, str(e).splitlines()[0])
            replica.proc = _Failed()
            replica.status, replica.started = "starting", time.monotonic()
            return
        replica.host, replica.port = replica.proc.host, replica.proc.port
        replica.status, replica.started, replica.kv_cache_blocks = "starting", time.monotonic(), None
        logger.info("replica %d: started on Ray node %s (pid %d, port %d, %d thread(s))", replica.index,
                    replica.host, replica.pid, replica.port, self.threads)
        self.on_start(replica)

    def start(self) -> None:
        for r in self.replicas:
            self.spawn(r)

    def terminate(self) -> None:
        """SIGTERM every child: each stops its requests at once (they end with a shutdown error) and exits."""
        self.stopping = True
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    r.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every child and wait for it; SIGKILL what is left after timeout (its whole process group)."""
        self.terminate()
        deadline = time.monotonic() + timeout
        for r in self.replicas:
            if r.proc is None:
                continue
            try:
                r.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("replica %d did not stop in %g s: killed", r.index, timeout)
            if self.ray:
                r.proc.kill()  # its process group, on its node; and the actor
            else:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(r.proc.pid, signal.SIGKILL)  # and anything it started
                with contextlib.suppress(subprocess.TimeoutExpired):
                    r.proc.wait(5)
            if r.status != "removed":
                r.status = "stopped"

    # ------------------------------------------------------------------ watching
    async def watch(self, client: httpx.AsyncClient) -> None:
        """Until stop: notice deaths, restart dead replicas after their back-off, mark started ones ready."""
        while not self.stopping:
            now = time.monotonic()
            for r in self.replicas:
                if self.stopping:
                    break
                if r.status in ("starting", "ready") and r.proc.poll() is not None:
                    self._died(r, now)
                elif r.status == "dead" and now >= r.restart_at:
                    r.restarts += 1
                    self.spawn(r)
                elif r.status == "starting":
                    await self._check_ready(client, r)
                elif r.status == "ready" and self.hang_timeout > 0:
                    self._check_alive(client, r, now)
            await asyncio.sleep(_WATCH_INTERVAL_S)

    def _check_alive(self, client: httpx.AsyncClient, r: Replica, now: float) -> None:
        """Probes a ready replica's /health now and then (in a task of its own: a stopped replica holds the
        probe until its timeout); kills it once it has answered none for hang_timeout seconds."""
        if now - r.last_answer > self.hang_timeout:
            logger.error("replica %d: no answer to health probes for %.0f s; killing it (pid %d)", r.index,
                         now - r.last_answer, r.pid)
            r.proc.kill()  # noticed as a death at the next pass, and restarted
            return
        if r.probing or now - r.last_probe < min(5.0, self.hang_timeout / 4):
            return
        r.probing, r.last_probe = True, now

        async def probe(proc=r.proc):
            try:
                answer = await client.get(r.url + "/health", timeout=self.hang_timeout)
                if answer.status_code == 200 and r.proc is proc:
                    r.last_answer = time.monotonic()
            except httpx.HTTPError:
                pass
            finally:
                r.probing = False

        task = asyncio.get_running_loop().create_task(probe())
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    def _died(self, r: Replica, now: float) -> None:
        code = r.proc.returncode
        if r.status == "starting":
            r.failed_starts += 1
        else:
            r.failed_starts = 0
        if r.failed_starts >= MAX_FAILED_STARTS:
            r.status = "removed"
            logger.error("replica %d: exited with %s before it was ready %d times in a row; removed", r.index,
                         code, r.failed_starts)
        else:
            delay = RESTART_BACKOFF_S[min(r.failed_starts, len(RESTART_BACKOFF_S) - 1)]
            r.status, r.restart_at = "dead", now + delay
            logger.error("replica %d: exited with %s; restarting in %g s", r.index, code, delay)
        self.on_death(r)

    async def _check_ready(self, client: httpx.AsyncClient, r: Replica) -> None:
        try:
            health = await client.get(r.url + "/health", timeout=1.0)
            if health.status_code != 200:
                return
            stats = await client.get(r.url + "/dashboard/stats", timeout=2.0,
                                     headers={"authorization": f"Bearer {self.secret}"})
            r.kv_cache_blocks = stats.json().get("kv_cache_blocks") if stats.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return
        if r.status == "starting" and r.proc.poll() is None:
            r.status, r.failed_starts, r.last_answer = "ready", 0, time.monotonic()
            logger.info("replica %d: ready after %.1f s", r.index, time.monotonic() - r.started)
            self.on_ready(r)


class _Failed:
    """A replica Ray could not place: an exited process, to the watcher."""

    pid, returncode = None, -1

    def poll(self):
        return -1

    def wait(self, timeout=None):
        return -1

    def send_signal(self, sig) -> None:
        pass

    def kill(self) -> None:
        pass

    def release(self) -> None:
        pass


def child_main() -> None:
    """Entry point of a replica: `tokenmill serve` with the arguments the front passed as JSON."""
    args = argparse.Namespace(**json.loads(sys.argv[1]))
    die_with_parent(args.parent_pid)
    args.api_key = None  # the front's shared secret comes in $TOKENMILL_API_KEY, out of the process list
    from tokenmill.server.app import run_server

    sys.exit(run_server(args))
