"""Tensor parallelism across processes: rank 0 (the engine's process) and the other ranks it starts.

Rank 0 keeps the scheduler, the sampler and everything else the engine owns; its model is wrapped so that
every call that runs the model first describes itself to the other ranks (RankZeroModel). Each other rank
(worker_main) loads its own shard, keeps its own slice of the KV cache (the same blocks, its heads), and
repeats each call on its shard; the sums inside the calls meet in the group. Their results stay on rank 0.

Processes: the engine starts the other ranks on this host (`python -m tokenmill.distributed.worker`, each in a
session of its own). They end with the engine: asked to stop when it closes; killed by the kernel when it dies,
where it started them from its main thread (PR_SET_PDEATHSIG fires when the starting thread ends, so not from a
loader thread); and in any case leaving on their own once rank 0's pid is gone. A rank that dies breaks the
group: every rank waiting in it returns, and rank 0's call raises instead of hanging.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import subprocess
import sys
import threading
import time

import torch

from tokenmill.distributed.group import ShmGroup
from tokenmill.kernels.cpu import usable_cpus

logger = logging.getLogger("tokenmill")

READY_TIMEOUT_S = 600.0  # a rank loading a large model from a slow disk


class TensorParallel:
    """Rank 0's handle on the group and the other ranks' processes: started here, or (group given) by a
    launcher such as torchrun (launch.py)."""

    def __init__(self, config, group=None) -> None:
        self.world = config.tensor_parallel_size
        self.launched = group is not None
        self.threads = torch.get_num_threads() if self.launched else max(1, usable_cpus() // self.world)
        self.group = group or ShmGroup.create(self.world)
        self.procs: list[subprocess.Popen] = []
        self._closed = threading.Event()
        # One caller at a time: a step's call (its message, then its sums) against close() from another thread.
        self.lock = threading.Lock()
        # PR_SET_PDEATHSIG fires when the thread that started a child ends: only the main thread's last.
        parent = os.getpid() if threading.current_thread() is threading.main_thread() else None
        fd = None if self.launched else self.group.fd
        fds = () if fd is None else (fd,)  # the group's memory file, under the same number there
        try:
            for rank in [] if self.launched else range(1, self.world):
                # Its own session: a Ctrl-C at the terminal (which stops a chat's answer) is rank 0's to handle.
                p = subprocess.Popen([sys.executable, "-m", "tokenmill.distributed.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True, pass_fds=fds,
                                     env={**os.environ, "OMP_NUM_THREADS": str(self.threads)})
                p.stdin.write(pickle.dumps((config, rank, self.world, self.group.path, self.threads, parent)))
                p.stdin.close()
                self.procs.append(p)
        except BaseException:
            self.close()
            raise
        torch.set_num_threads(self.threads)
        self._watch = threading.Thread(target=self._watchdog, name="tokenmill-tp-watch", daemon=True)
        self._watch.start()

    def start(self, num_blocks: int, max_model_len: int) -> None:
        """After rank 0 has loaded its shard and sized the KV cache: the other ranks size theirs alike, and
        this returns once every one has loaded and is ready (or raises with the failing rank's error)."""
        if self.launched:
            self.group.send(("init", num_blocks, max_model_len))
            logger.info("tensor parallel: %d ranks started by a launcher, summing through %s", self.world,
                        "shared memory" if isinstance(self.group, ShmGroup) else "torch.distributed (gloo)")
            return
        deadline = time.monotonic() + READY_TIMEOUT_S
        for rank, p in enumerate(self.procs, start=1):
            line = b""
            while not line.endswith(b"\n"):
                ready, _, _ = select.select([p.stdout], [], [], 0.2)
                if ready:
                    chunk = p.stdout.readline()
                    if not chunk:  # the rank exited
                        break
                    line += chunk
                elif time.monotonic() > deadline:
                    break
            status = line.decode(errors="replace").strip()
            if status != "ready":
                self.close()
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: "
                                   f"{status.removeprefix('error: ') or 'it exited (its log says why)'}")
        self.group.send(("init", num_blocks, max_model_len))
        self.group.unlink()  # every rank has mapped it
        logger.info("tensor parallel: %d ranks on this host, %d thread%s each, summing through shared memory",
                    self.world, self.threads, "" if self.threads == 1 else "s")

    def _watchdog(self) -> None:
        """Breaks the group when a rank's process ends (rank 0 would otherwise wait for its sums for ever)."""
        while not self._closed.wait(0.2):
            for rank, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    if not self._closed.is_set():
                        logger.error("tensor-parallel rank %d exited (code %s): the engine cannot run steps",
                                     rank, p.returncode)
                    self.group.close()
                    return

    def call(self, message: tuple, fn, *args):
        """Sends a model call to the other ranks, then runs it here (their sums meet). Any failure leaves the
        ranks out of step, so it breaks the group for good."""
        with self.lock:
            try:
                self.group.send(message)
                return fn(*args)
            except BaseException:
                self.group.close()
                raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        """Stops the other ranks (asked, then killed) and frees the group."""
        if self._closed.is_set():
            return
        self._closed.set()
        # A call still running on another thread (a shutdown that did not wait for the engine's step): the
        # group is broken under it, so it raises, rather than a "stop" arriving in the middle of its sums.
        idle = self.lock.acquire(timeout=5.0)
        try:
            if idle and not self.group.broken() and all(p.poll() is None for p in self.procs):
                with contextlib.suppress(Exception):
                    self.group.send(("stop",))
        finally:
            if idle:
                self.lock.release()
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()
        self.group.close()
        self.group.unlink()
        if self.launched:
            from tokenmill.distributed.launch import leave

            leave()


class RankZeroModel:
    """Rank 0's model: each call that runs it is first sent to the other ranks, which run it on their shards
    (the calls meet in the group's sums). Any other attribute is the model's own."""

    def __init__(self, model, tp: TensorParallel) -> None:
        self.__dict__["_model"] = model
        self.__dict__["_tp"] = tp

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __setattr__(self, name, value):
        """A switch set on the model (use_fused_decode, say) is set on every rank's."""
        self._tp.call(("set", name, value), setattr, self._model, name, value)

    def _fused(self, kv_caches, meta) -> bool:
        """Whether this call runs the fused decode step: every rank must take the same path (their sums
        differ), so the others check rank 0's choice against theirs."""
        return self._model._fused_decoder(kv_caches, meta) is not None

    def __call__(self, input_ids, positions, kv_caches, meta):
        return self._tp.call(("forward", input_ids, positions, meta, self._fused(kv_caches, meta)), self._model,
                             input_ids, positions, kv_caches, meta)

    def decode_logits(self, input_ids, positions, kv_caches, meta):
        return self._tp.call(("decode_logits", input_ids, positions, meta, self._fused(kv_caches, meta)),
                             self._model.decode_logits, input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden):
        return self._tp.call(("logits", hidden), self._model.compute_logits, hidden)

    def _fused_decoder(self, kv_caches, meta):
        fused = self._model._fused_decoder(kv_caches, meta)
        return None if fused is None else _RankZeroFused(fused, meta, self)


class _RankZeroFused:
    """Rank 0's fused decoder for a burst: decode_greedy runs on every rank."""

    def __init__(self, fused, meta, model: RankZeroModel) -> None:
        self.fused, self.meta, self.model = fused, meta, model

    def decode_greedy(self, input_ids, positions, slots, block_tables, seq_lens, stop_ids):
        message = ("burst", self.meta, input_ids, positions, slots, block_tables, seq_lens, stop_ids)
        return self.model._tp.call(message, self.fused.decode_greedy, input_ids, positions, slots, block_tables,
                                   seq_lens, stop_ids)

    def __getattr__(self, name):  # interrupt, clear_interrupt: rank 0's alone (its flag reaches the others)
        return getattr(self.fused, name)


