"""Data-parallel replicas on a Ray cluster (`--distributed-executor-backend ray`): each replica's
`tokenmill serve` runs on whichever node Ray places it, started and watched by a small actor there.

Ray places a replica where its CPUs (usable CPUs / N of the front's machine) are free; the actor starts the
replica's process on its node, listening on the node's address, and answers the front's questions about it
(alive? exit code?) and its orders (signal, kill). To the front's ReplicaSet a RayProcess looks like the
subprocess.Popen of a local replica, so health probes, restarts, removal and shutdown work the same. Every node must be able to load the model: a path on a file system they share, or a
known name each one can fetch.
"""

from __future__ import annotations

import logging
import subprocess

logger = logging.getLogger("tokenmill")

_CALL_TIMEOUT_S = 10.0


def connect(address: str | None) -> None:
    """Joins the Ray cluster at address ("auto": the one this machine belongs to), or starts a local one."""
    try:
        import ray
    except ImportError:
        raise ValueError("--distributed-executor-backend ray needs Ray: pip install ray") from None
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_DEDUP_LOGS": "0"}})
        nodes = [f"{n['NodeManagerAddress']} ({n['Resources'].get('CPU', 0):g} CPUs)" for n in ray.nodes()
                 if n.get("Alive")]
        logger.info("data parallel on Ray: %s", ", ".join(nodes))


def disconnect() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _host_class():
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class ReplicaHost:
        """On a node of the cluster: one replica's `tokenmill serve` process."""

        def __init__(self) -> None:
            self.proc = None

        def start(self, child_args: dict, env: dict) -> tuple[str, int, int]:
            """Starts the replica on this node; (its address, port, pid)."""
            import json
            import os
            import sys

            from tokenmill.server.replicas import free_port

            host = ray.util.get_node_ip_address()
            port = free_port(host)
            child_args = {**child_args, "host": host, "port": port, "parent_pid": os.getpid()}
            cmd = [sys.executable, "-c", "from tokenmill.server.replicas import child_main; child_main()",
                   json.dumps(child_args)]
            self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, start_new_session=True)
            return host, port, self.proc.pid

        def poll(self):
            return self.proc.poll()

        def signal(self, sig: int) -> None:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)

        def wait(self, timeout: float):
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return None

        def kill(self):
            import os
            import signal

            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # and anything it started
            except (ProcessLookupError, PermissionError):
                pass
            return self.proc.wait()

    return ReplicaHost


_HOST = None


class RayProcess:
    """A replica's process on a Ray node, with the parts of subprocess.Popen's interface the front uses. An
    actor that can no longer be reached (its node lost) counts as a process that exited with -1."""

    def __init__(self, num_cpus: float, child_args: dict, env: dict) -> None:
        import ray

        global _HOST
        _HOST = _HOST or _host_class()
        self._ray = ray
        self.actor = _HOST.options(num_cpus=num_cpus).remote()
        self.returncode = None
        try:
            self.host, self.port, self.pid = ray.get(self.actor.start.remote(child_args, env), timeout=120)
        except BaseException:
            ray.kill(self.actor)
            raise

    def _ask(self, call, timeout: float = _CALL_TIMEOUT_S):
        try:
            return self._ray.get(call, timeout=timeout)
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.GetTimeoutError):
            self.returncode = -1 if self.returncode is None else self.returncode
            return self.returncode

    def poll(self):
        if self.returncode is None:
            self.returncode = self._ask(self.actor.poll.remote())
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self._ask(self.actor.signal.remote(int(sig)))

    def wait(self, timeout: float | None = None):
        if self.returncode is None:
            code = self._ask(self.actor.wait.remote(timeout or 0.0), (timeout or 0.0) + _CALL_TIMEOUT_S)
            if code is None:
                raise subprocess.TimeoutExpired("replica", timeout)
            self.returncode = code
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self.returncode = self._ask(self.actor.kill.remote())
        self.release()

    def release(self) -> None:
        """Ends the actor (and frees the CPUs Ray reserved for it); its replica has exited or been killed."""
        try:
            self._ray.kill(self.actor)
        except Exception:
            pass
