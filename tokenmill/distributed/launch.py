"""Ranks started by torchrun (or any launcher that sets torch.distributed's environment: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), on one host or several.

Every rank runs the same command, e.g. on each of two hosts

    torchrun --nnodes 2 --node-rank N --nproc-per-node 1 --master-addr HOST0 --master-port 29500 \\
        -m tokenmill.cli serve MODEL --tensor-parallel-size 2

Rank 0 becomes the engine (and the server); every other rank's engine constructor loads its shard, serves
rank 0's calls, and ends its process when rank 0 stops. The ranks meet in gloo's process group. Where they
all share one host they sum through shared memory as the engine's own ranks do (the fused decode step
included); across hosts through gloo, and decode steps run module by module.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys

import torch

logger = logging.getLogger("tokenmill")

# A rank waits for rank 0's next step for as long as the server is idle: no timeout of gloo's may cut that.
IDLE_FOREVER = datetime.timedelta(days=3650)


def launched_world() -> tuple[int, int, int] | None:
    """(rank, world, ranks on this host) where a launcher started this process as one of several ranks."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    world = int(env["WORLD_SIZE"])
    return (int(env["RANK"]), world, int(env.get("LOCAL_WORLD_SIZE", world))) if world > 1 else None


def join(config):
    """Rank 0's group of the launched ranks; a rank other than 0 does not return: it serves rank 0 until
    rank 0 stops, then exits."""
    import torch.distributed as dist

    from tokenmill.distributed.group import ShmGroup, TorchGroup
    from tokenmill.kernels.cpu import usable_cpus

    rank, world, local = launched_world()
    if world != config.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} must equal the launcher's "
                         f"WORLD_SIZE ({world})")
    dist.init_process_group("gloo", timeout=IDLE_FOREVER)
    # torchrun sets one thread a process where it starts several; the ranks of a host share its CPUs instead.
    torch.set_num_threads(max(1, usable_cpus() // local))
    if local == world:  # one host: shared memory
        created = ShmGroup.create(world, for_children=False) if rank == 0 else None
        box = [created.path if created else None]
        dist.broadcast_object_list(box, src=0)
        group = created or ShmGroup.attach(box[0], rank, world)
        dist.barrier()
        group.unlink()
    else:
        group = TorchGroup()
    if rank == 0:
        return group
    from tokenmill.distributed import worker

    worker.quiet_logging()
    try:
        worker.run(config, group, worker.load_shard(config, rank, world, group))
    finally:
        group.close()
        leave()
    sys.exit(0)


def leave() -> None:
    """Ends this rank's part in the launcher's process group: left to the interpreter's exit, gloo's threads
    can abort the process (SIGABRT, "terminate called without an active exception") once the peers are gone."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # the peers went first
            pass
