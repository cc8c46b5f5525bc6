"""A tensor-parallel rank other than 0, as a process of its own (`python -m tokenmill.distributed.worker`,
started by executor.TensorParallel): it loads its shard, says "ready" (or "error: ...") on stdout, then runs
rank 0's calls until told to stop or until rank 0 is gone.

Its arguments come pickled on stdin: (EngineConfig, rank, world, the group's buffer path, threads, and the
parent's pid to die with, or None)."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import sys
import traceback

import torch

from tokenmill.distributed.group import ShmGroup
from tokenmill.distributed.process import die_with_parent


def main() -> None:
    config, rank, world, path, threads, parent = pickle.loads(sys.stdin.buffer.read())
    if parent is not None:
        die_with_parent(parent)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the status line is the pipe's only content: anything else printed goes to stderr
    sys.stdout = sys.stderr
    torch.set_num_threads(threads)
    group = None
    try:
        quiet_logging()
        group = ShmGroup.attach(path, rank, world)
        group.watch_parent(os.getppid())  # rank 0: gone, even as a zombie, once this process is re-parented
        loaded = load_shard(config, rank, world, group)
    except BaseException as e:
        out.write(f"error: {type(e).__name__}: {e}".replace("\n", " ") + "\n")
        out.flush()
        if group is not None:
            group.close()
        sys.exit(1)
    out.write("ready\n")
    out.flush()
    try:
        run(config, group, loaded)
    except BaseException:
        traceback.print_exc()
        group.close()
        sys.exit(1)


def quiet_logging() -> None:
    from tokenmill.llm import _configure_logging

    _configure_logging()
    logging.getLogger("tokenmill").setLevel(logging.WARNING)  # rank 0 says what the ranks load


def load_shard(config, rank: int, world: int, group):
    """This rank's LoadedModel."""
    from tokenmill.attention.backend import new_backend
    from tokenmill.config import resolve_device, resolve_dtype
    from tokenmill.model.loader import load_model

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, None)
    return load_model(config.model, dtype, device, new_backend(device), max_positions=config.max_model_len,
                      quantization=config.quantization, tensor_parallel=(rank, world, group))


def run(config, group, loaded) -> None:
    """Waits for rank 0's KV cache size, makes this rank's cache alike, then serves rank 0's calls."""
    from tokenmill.runner import ModelRunner

    message = group.recv()
    if message is None or message[0] != "init":
        return
    _, num_blocks, max_model_len = message
    model = loaded.model
    weight = model.norm.weight
    runner = ModelRunner(model, num_blocks, config.block_size, weight.device, weight.dtype, config.seed,
                         max_model_len=max_model_len, kv_cache_dtype=config.kv_cache_dtype)
    serve(group, model, runner)


@torch.inference_mode()
def serve(group, model, runner) -> None:
    """Runs rank 0's calls on this rank's shard, until "stop" or a broken group."""
    kv = runner.kv_caches
    governor = runner.governor or contextlib.nullcontext()
    while True:
        message = group.recv()
        if message is None or message[0] == "stop":
            return
        op, *args = message
        if op == "set":
            setattr(model, *args)
            continue
        if op in ("forward", "decode_logits"):
            ids, pos, meta, fused = args
            if (model._fused_decoder(kv, meta) is not None) != fused:
                raise RuntimeError(f"rank 0 {'runs' if fused else 'does not run'} the fused decode step for this "
                                   "call and this rank cannot follow: the ranks' sums would not meet")
        with governor:
            if op == "forward":
                model(ids, pos, kv, meta)
            elif op == "decode_logits":
                model.decode_logits(ids, pos, kv, meta)
            elif op == "logits":
                model.compute_logits(args[0])
            elif op == "burst":
                meta, ids, pos, slots, bt, lens, stop_ids = args
                fused = model._fused_decoder(kv, meta)
                if fused is None:
                    raise RuntimeError("rank 0 runs a burst of fused decode steps this rank cannot run")
                fused.clear_interrupt()
                fused.decode_greedy(ids, pos, slots, bt, lens, stop_ids)
            else:
                raise RuntimeError(f"unknown tensor-parallel call {op!r}")


if __name__ == "__main__":
    main()
