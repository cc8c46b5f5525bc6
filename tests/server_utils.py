"""A real `tokenmill serve` subprocess on 127.0.0.1 and a free port, always stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, *args: str, env: dict | None = None, ready_timeout: float = 120.0,
                 log_path: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tokenmill.cli", "serve", model, "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "warning", *args]
        if log_path is not None:  # the test reads what the server logged
            self.log = open(log_path, "w")
        else:
            self.log = open(os.devnull, "w") if not os.environ.get("TOKENMILL_TEST_SERVER_LOGS") else None
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=self.log, stderr=self.log)
        self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was ready")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError("server not ready in time")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        values = {}
        for line in text.splitlines():
            if line.startswith("tokenmill:") and "{" in line:
                name = line.split("{", 1)[0]
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return values

    def wait_metric(self, name: str, predicate, timeout: float = 15.0) -> float:
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.metrics().get(name)
            if value is not None and predicate(value):
                return value
            time.sleep(0.1)
        raise AssertionError(f"{name} stayed at {value}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()
        return self.proc.returncode
