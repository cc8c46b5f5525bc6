"""The tensor-parallel ranks as a group: sums and gathers over the ranks, and rank 0's step descriptions.

Two transports behind one interface:
- ShmGroup: the ranks of one host, through a buffer each of them maps (kernels/shm_group.h). A sum of a few
  KiB takes microseconds, and the fused CPU decode step calls it from inside its own loop, twice a layer.
- TorchGroup: torch.distributed (gloo on CPUs, between hosts too; NCCL on GPUs). About 0.8 ms a sum over
  loopback TCP on a 2-core machine, so decode steps run module by module there; it is the transport for
  ranks on several hosts, started by torchrun.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import tempfile

import torch

# Floats per rank and slot of a ShmGroup (larger sums go in pieces), and bytes of its message area (larger
# messages too).
SHM_CAPACITY = 1 << 19
SHM_MESSAGE_BYTES = 16 << 20


class _StepPickler(pickle.Pickler):
    """Pickles CPU tensors as numpy arrays: a step's description holds a dozen small tensors, which torch's own
    pickling takes ~15 us each to write and ~20 to read, on the path of every step."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.requires_grad:
            if obj.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as int16
                return _bfloat16, (obj.contiguous().view(torch.int16).numpy(),)
            return torch.from_numpy, (obj.contiguous().numpy(),)
        return NotImplemented


def _bfloat16(bits):
    return torch.from_numpy(bits).view(torch.bfloat16)


def pack(message) -> bytes:
    out = io.BytesIO()
    _StepPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return out.getvalue()


def _kernels():
    from tokenmill.kernels import cpu

    kernels = cpu.load()
    if kernels is None:
        raise RuntimeError("tensor parallelism on the CPU needs the compiled CPU kernels, which could not be built")
    return kernels


def _size(world: int) -> int:
    """Bytes of a ShmGroup's buffer for world ranks."""
    return _kernels().ShmGroup.bytes(world, SHM_CAPACITY, SHM_MESSAGE_BYTES)


class ShmGroup:
    """The ranks of one host over a buffer each of them maps: an anonymous memory file rank 0 creates and hands
    its children (nothing in any file system to leak), or a file in /dev/shm for ranks a launcher started,
    removed once every rank has mapped it. Its memory is reserved when it is made, so a full /dev/shm fails
    there, with an error, not later with a SIGBUS."""

    def __init__(self, path: str, rank: int, world: int, fd: int | None = None) -> None:
        kernels = _kernels()
        self.path, self.rank, self.world, self.fd = path, rank, world, fd
        self.buffer = torch.from_file(path, shared=True, size=_size(world), dtype=torch.uint8)
        self.kernel = kernels.ShmGroup(self.buffer, rank, world, SHM_CAPACITY, SHM_MESSAGE_BYTES)

    @classmethod
    def create(cls, world: int, for_children: bool = True) -> "ShmGroup":
        """Rank 0's group: a new zeroed buffer. for_children: an anonymous memory file, whose descriptor
        (.fd) the other ranks inherit (attach(f"/proc/self/fd/{fd}")); else a file in /dev/shm (.path)."""
        size = _size(world)
        if for_children and hasattr(os, "memfd_create"):
            fd = os.memfd_create("tokenmill-tp", 0)
            path = f"/proc/self/fd/{fd}"
        else:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, path = tempfile.mkstemp(prefix="tokenmill-tp-", dir=folder)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            if not path.startswith("/proc/"):
                os.unlink(path)
            raise RuntimeError(f"cannot reserve {size >> 20} MiB of shared memory for the tensor-parallel ranks: "
                               f"{e.strerror}") from None
        if path.startswith("/proc/"):
            return cls(path, 0, world, fd)
        os.close(fd)
        return cls(path, 0, world)

    @classmethod
    def attach(cls, path: str, rank: int, world: int) -> "ShmGroup":
        return cls(path, rank, world)

    def watch_parent(self, pid: int) -> None:
        """This rank leaves the group (it counts as broken) once its parent is no longer pid."""
        self.kernel.watch_parent(pid)

    def unlink(self) -> None:
        """Removes the buffer's name, if it has one in a file system (every rank has mapped it by then)."""
        if not self.path.startswith("/proc/"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (added in rank order: every rank gets the same bits)."""
        x = x.contiguous()
        self.kernel.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[world, *x.shape]: every rank's x (float32), in rank order."""
        out = self.kernel.all_gather(x.float().contiguous().reshape(-1))
        return out.view(self.world, *x.shape)

    def send(self, message) -> None:
        """Rank 0: a step description to every other rank (one larger than the message area in pieces)."""
        data = pack(message)
        room = SHM_MESSAGE_BYTES - 1
        if len(data) <= room:
            parts = [b"\0" + data]
        else:
            parts = [b"\1" + (-(-len(data) // room)).to_bytes(8, "little")]
            parts += [data[i:i + room] for i in range(0, len(data), room)]
        for part in parts:
            if not self.kernel.send(part):
                raise RuntimeError("a tensor-parallel rank has stopped")

    def recv(self):
        """The other ranks: rank 0's next message; None once the group is broken (rank 0 gone, or closed)."""
        first = self.kernel.recv()
        if first is None:
            return None
        if first[0] == 0:
            return pickle.loads(memoryview(first)[1:])
        parts = [self.kernel.recv() for _ in range(int.from_bytes(first[1:9], "little"))]
        return None if any(p is None for p in parts) else pickle.loads(b"".join(parts))

    def broken(self) -> bool:
        return self.kernel.broken()

    def stats(self, rank: int | None = None) -> tuple[int, float, float]:
        """A rank's (default: this one's) sums and gathers run, seconds in them, and seconds of that waiting
        for the other ranks."""
        return self.kernel.stats(self.rank if rank is None else rank)

    def close(self) -> None:
        """Marks the group broken: every rank waiting in it returns (the others' recv gives None)."""
        self.kernel.mark_broken()

    @property
    def fused(self):
        """The kernel group the fused decode step sums through."""
        return self.kernel


class TorchGroup:
    """The ranks over torch.distributed's default process group (gloo or NCCL), however it was started."""

    fused = None  # the fused CPU decode step cannot call into it: decode steps run module by module

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._broken = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # In float32, as ShmGroup sums: bfloat16 partial sums would round at every addition.
        y = x.float().contiguous()
        self.dist.all_reduce(y)
        return y.to(x.dtype)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        out = [torch.empty_like(x) for _ in range(self.world)]
        self.dist.all_gather(out, x)
        return torch.stack(out)

    def send(self, message) -> None:
        self.dist.broadcast_object_list([message], src=0)

    def recv(self):
        box = [None]
        try:
            self.dist.broadcast_object_list(box, src=0)
        except RuntimeError:  # rank 0 gone
            return None
        return box[0]

    def broken(self) -> bool:
        return self._broken

    def close(self) -> None:
        self._broken = True

    def unlink(self) -> None:
        pass
