"""CPU kernels for the decode step (tokenmill/kernels/cpu_kernels.cpp), compiled on first use.

- gemv_bf16: decoding a token reads every weight once, so a decode step is bound by memory bandwidth;
  torch's bf16 GEMM reaches well under half of this machine's bandwidth when the batch has one or a few
  rows. This kernel streams each weight row once per pass over up to a few input rows, accumulating
  with the `vdpbf16ps` instruction, and prefetches the weight stream ahead of itself.
- paged_decode_attention: single-query attention read straight from the paged KV cache through each
  request's block table, so the keys and values are read once and never gathered into a copy.
- FusedDecoderF32 / FusedDecoderBF16: a whole decode step of a Llama-family decoder in one call (the
  model builds it from its own weights, dense or in GGUF block formats), so the small per-layer
  operations cost no Python dispatch.

They are written here because no maintained library ships such kernels for torch on the CPU. They need
AVX-512 (F, BW, VL, DQ); its BF16 instructions are emulated where the CPU lacks them (bf16 models run
slower there; such CPUs default to float32). Where they cannot be built (no compiler, no AVX-512) the
engine keeps its torch code paths. torch caches the build per machine (~/.cache/torch_extensions).
"""

from __future__ import annotations

import hashlib
import logging
import os

import torch

logger = logging.getLogger("tokenmill")

_DIR = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_DIR, "cpu_kernels.cpp")
_HEADERS = [os.path.join(_DIR, "quant.h")]
_NEEDED = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # the kernels' instruction sets

_module = None
_tried = False


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def usable_cpus(cgroup: str = "/sys/fs/cgroup") -> int:
    """The CPUs this process can keep busy: those its affinity mask allows, and no more than its cgroup's
    CPU quota (v2 cpu.max "QUOTA PERIOD", v1 cpu.cfs_quota_us / cpu.cfs_period_us), rounded down: a thread
    over the quota is throttled, which a team meeting at barriers feels as a lost core."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = period = None
    try:
        with open(os.path.join(cgroup, "cpu.max")) as f:
            q, p = f.read().split()[:2]
        quota, period = (None if q == "max" else int(q)), int(p)
    except (OSError, ValueError):
        try:
            with open(os.path.join(cgroup, "cpu", "cpu.cfs_quota_us")) as f, \
                    open(os.path.join(cgroup, "cpu", "cpu.cfs_period_us")) as g:
                quota, period = int(f.read()), int(g.read())
        except (OSError, ValueError):
            pass
    if quota is not None and quota > 0 and period:
        cpus = min(cpus, quota // period)
    return max(1, cpus)


def fit_threads() -> int:
    """Lowers torch's intra-op thread count (the kernels' teams follow it) to usable_cpus(); returns it."""
    usable = usable_cpus()
    if torch.get_num_threads() > usable:
        logger.info("using %d threads: the CPUs this process may use (affinity, cgroup quota)", usable)
        torch.set_num_threads(usable)
    return torch.get_num_threads()


def build(source: str) -> object:
    """Compiles a kernel source file (this package's, or another version of it to compare against) for
    this CPU: with its AVX-512 BF16 instructions where it has them, emulated where it does not."""
    from torch.utils.cpp_extension import load as compile_extension

    digest = hashlib.sha256()
    for path in [source, *_HEADERS]:
        with open(path, "rb") as f:
            digest.update(f.read())
    # -march=native: the build is for this CPU, so the name carries its flags as well as the sources
    # (a changed source or another CPU never meets a stale build).
    digest.update(" ".join(sorted(_cpu_flags())).encode())
    return compile_extension(
        name=f"tokenmill_cpu_kernels_{digest.hexdigest()[:12]}", sources=[source],
        extra_cflags=["-O3", "-march=native", f"-I{_DIR}", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)


def load() -> object | None:
    """The compiled kernel module, or None where it cannot be used (reason logged once)."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS"):
        return None
    missing = [f for f in _NEEDED if f not in _cpu_flags()]
    if missing:
        logger.info("CPU lacks %s: decode uses torch's own kernels", ", ".join(missing))
        return None
    try:
        _module = build(_SOURCE)
    except Exception as e:  # no compiler, no headers: the torch path still works
        logger.warning("could not build the CPU decode kernels (%s); using torch's own", str(e).splitlines()[0])
        _module = None
    return _module


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the kernel when the batch is small (max_gemv_rows rows at most) bf16 on the CPU."""
    if (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.dim() == 2 and x.device.type == "cpu"
            and _module is not None and x.shape[0] <= _module.max_gemv_rows and x.shape[1] % 32 == 0
            and (bias is None or bias.dtype == torch.bfloat16)):
        return _module.gemv_bf16(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a 2-D float32 or bfloat16 tensor; the kernel on the CPU (torch's takes ~1 ns
    per element, ~45 us for one float32 row of a 49k vocabulary, ~180 us in bfloat16)."""
    if (x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and x.device.type == "cpu" and x.shape[1]
            and _module is not None):
        return _module.argmax_rows(x)
    return x.argmax(dim=-1)
