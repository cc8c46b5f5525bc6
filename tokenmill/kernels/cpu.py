"""CPU kernels for the decode step (tokenmill/kernels/cpu_kernels.cpp), compiled on first use.

- gemv_bf16: decoding a token reads every weight once, so a decode step is bound by memory bandwidth;
  torch's bf16 GEMM reaches well under half of this machine's bandwidth when the batch has one or a few
  rows. This kernel streams each weight row once per pass over up to a few input rows, accumulating
  with the `vdpbf16ps` instruction, and prefetches the weight stream ahead of itself.
- paged_decode_attention: single-query attention read straight from the paged KV cache through each
  request's block table, so the keys and values are read once and never gathered into a copy.
- prefill_attention: causal attention of a bfloat16 prompt chunk over its prefix and itself, in bf16
  pair products (torch's CPU flash attention ran a 736-token prompt's attention at ~100 GFLOP/s, near
  half of its prefill time), each row computed alike in whatever chunk it falls; on CPUs with AMX, for head
  sizes a multiple of 64, on its bfloat16 tiles (scores and outputs transposed: 16 query rows a tile's
  columns, the softmax a vector operation over them), ~4x the pair products' rate.
- FusedDecoderF32 / FusedDecoderBF16: a whole decode step in one call (the model builds it from its own
  weights, dense or in GGUF block formats, and its description: model/description.py), so the small
  per-layer operations cost no Python dispatch.

They are written here because no maintained library ships such kernels for torch on the CPU. They are
written in AVX-512 (F, BW, VL, DQ) intrinsics; on x86-64 CPUs with AVX2, FMA and F16C instead (most laptops
and desktops) the same source builds through SIMDe (simd.h), each 512-bit operation done as two 256-bit
ones. AVX-512's BF16 instructions are emulated where the CPU lacks them (bf16 models run slower there; such
CPUs default to float32). Where they cannot be built (no compiler, neither instruction set) the engine keeps
its torch code paths. torch caches the build per machine (~/.cache/torch_extensions).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time

import torch

logger = logging.getLogger("tokenmill")

_DIR = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_DIR, "cpu_kernels.cpp")
_HEADERS = [os.path.join(_DIR, name) for name in ("quant.h", "quant_lowbit.h", "quant_product.h", "quant_amx.h", "quant_tiles.h",
                                                  "quant_pairs.h", "simd.h", "shm_group.h")]
_NEEDED = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # the kernels' instruction sets
_NEEDED_SIMDE = ("avx2", "fma", "f16c")  # ... or these, with SIMDe carrying out the AVX-512 intrinsics

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


def simd_cflags() -> list[str] | None:
    """The compiler flags, besides -march=native, that give the kernels their AVX-512 intrinsics on this
    CPU: none where it has AVX-512; SIMDe's where it has AVX2, FMA and F16C instead (also on request,
    TOKENMILL_KERNELS_SIMDE=1, to try that build on an AVX-512 CPU); None where neither can be had."""
    flags = _cpu_flags()
    native = all(f in flags for f in _NEEDED)
    if native and not os.environ.get("TOKENMILL_KERNELS_SIMDE"):
        return []
    if native or all(f in flags for f in _NEEDED_SIMDE):
        try:
            import simde_py
        except ImportError:
            return None
        # On an AVX-512 CPU, the build an AVX2 CPU gets: no AVX-512 instruction at all (with it, the compiler's
        # own AVX-512 types and SIMDe's meet, and the build would not be the one being tried).
        no_avx512 = ["-mno-avx512f"] if native else []
        return ["-DTOKENMILL_SIMDE", f"-I{simde_py.get_include()}", *no_avx512]
    return None


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
    if _module is not None:
        _module.set_plan_threads(torch.get_num_threads())
    return torch.get_num_threads()


class RunDelay:
    """How long each of this process's threads has spent on a CPU and ready to run but waiting for one, in
    seconds (the first two fields of /proc/self/task/TID/schedstat), by thread id: (ran, waited). The files
    stay open and are read again at offset 0, a few microseconds each; the list of threads is renewed every
    `renew` readings (a thread met for the first time counts from then on: compare readings over the
    threads in both)."""

    def __init__(self, renew: int = 64) -> None:
        import weakref

        self.renew, self.readings = renew, 0
        self.files: dict[str, int] = {}
        weakref.finalize(self, RunDelay._close_all, self.files)

    @staticmethod
    def _close_all(files: dict[str, int]) -> None:
        for fd in files.values():
            os.close(fd)
        files.clear()

    def _renew(self) -> None:
        try:
            tids = set(os.listdir("/proc/self/task"))
        except OSError:
            tids = set()
        for tid in list(self.files):
            if tid not in tids:
                os.close(self.files.pop(tid))
        for tid in tids - set(self.files):
            try:
                self.files[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                pass

    def __call__(self) -> dict[str, tuple[float, float]]:
        if self.readings % self.renew == 0:
            self._renew()
        self.readings += 1
        times = {}
        for tid, fd in self.files.items():
            try:
                ran, waited = os.pread(fd, 96, 0).split()[:2]
                times[tid] = (int(ran) * 1e-9, int(waited) * 1e-9)
            except (OSError, ValueError):  # the thread has ended
                pass
        return times

    @staticmethod
    def between(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
                min_ran: float = 0.0, skip: frozenset[str] | set[str] = frozenset()) -> float:
        """Seconds waited from one reading to a later one, over the threads present in both that ran for
        at least min_ran seconds in between, leaving out those in skip."""
        return sum(w - before[tid][1] for tid, (r, w) in after.items()
                   if tid in before and tid not in skip and r - before[tid][0] >= min_ran)


def bystander_threads() -> set[str]:
    """The ids of this process's Python threads other than the calling one: a step runs on its caller and
    the kernels' pool threads (which are not Python threads), so these take no part in it (a server's
    event loop, a loader, a watchdog)."""
    me = threading.get_native_id()
    return {str(t.native_id) for t in threading.enumerate() if t.native_id is not None and t.native_id != me}


class ThreadGovernor:
    """Runs the engine's steps on the whole team of threads while its CPUs are free, and on one thread
    while another process holds one of them (`with governor:` around a step).

    A team meets at joins and barriers many times per step. When the OS gives one thread's core to
    another process, each meeting waits for the scheduler to hand it back, and the step runs several
    times slower than it would on one thread: a prompt step of six requests of the default model took
    0.7 s quiet, 4.7 s on two threads beside a process spinning on one CPU, 1.0 s on one thread beside
    it. The sign is the time the process's threads spent ready to run but waiting for a CPU (RunDelay),
    against the step's wall time: a small share while the CPUs are shared with light work, most of the
    step when a thread keeps losing its core. (CPU time over wall time would not do: a step that is
    mostly serial Python looks the same.) Only threads that ran for a part of the step count
    (MIN_RAN_SHARE): a library's pool thread that is woken and goes back to sleep without work (two such
    threads appear at the first steps after a load, waiting 8-40 ms each to be scheduled beside the
    team's threads) would otherwise read as contention, and held fresh processes on a quiet machine on one
    thread from their first steps on (10 of 10 in one run of `benchmarks/governor_start.py`). A thread
    that shares its core with another process still runs for a fair part of each step, so it counts.
    The process's other Python threads do not (bystander_threads): a server's event loop, woken to stream
    each token, waits for a CPU through most of a decode step because the team holds both, which says
    nothing of the team. Counted, they held a server streaming one request on one thread for about half its
    steps on a quiet machine, at 4.2 ms a step against the team's 3.0 ms.
    After two such steps in a row the steps run on one thread for hold_s, then the team is tried again.
    The hold doubles, up to max_hold_s, for as long as the contention lasts (one slow step then
    suffices), and returns to hold_s after a step that ran freely.

    The kernels plan their splits for the whole team whatever runs a step (set_plan_threads), so the
    numbers do not change with the thread count.
    """

    MIN_STEP_S = 0.003  # shorter steps say too little
    # Run delay over wall time above this: a team thread keeps losing its core. Under a loaded server with
    # its load generator on the same 2 CPUs, steps measured 0.1 (median) and 0.25 (90th percentile); beside
    # a process spinning on one CPU, 0.85 (median) and 0.71 (10th percentile).
    WAITED = 0.5
    MIN_RAN_SHARE = 0.02  # of the step's wall time: a thread that ran less did none of the step's work

    def __init__(self, team: int, hold_s: float = 1.0, max_hold_s: float = 16.0, clock=None,
                 run_delay=None) -> None:
        self.team, self.hold_s, self.max_hold_s = team, hold_s, max_hold_s
        self.clock, self.run_delay = clock or time.monotonic, run_delay or RunDelay()
        self.solo_until = 0.0
        self.hold = hold_s
        self.slow_in_a_row = 0
        self.steps = self.solo_steps = self.switches = 0
        self._start, self._delay = 0.0, {}
        self._threads = self._outside = team

    def __enter__(self) -> "ThreadGovernor":
        now = self.clock()
        self._threads = 1 if now < self.solo_until else self.team
        self._outside = torch.get_num_threads()
        if self._outside != self._threads:
            torch.set_num_threads(self._threads)
        if self._threads > 1:
            self._delay = self.run_delay()
        self._start = now
        return self

    def __exit__(self, *exc) -> None:
        if self._outside != self._threads:  # the thread count is process-wide: leave it as it was found
            torch.set_num_threads(self._outside)
        self.steps += 1
        if self._threads == 1:
            self.solo_steps += 1
            return
        now = self.clock()
        wall = now - self._start
        if wall < self.MIN_STEP_S:
            return
        waited = RunDelay.between(self._delay, self.run_delay(), self.MIN_RAN_SHARE * wall, bystander_threads())
        if waited / wall <= self.WAITED:
            self.slow_in_a_row, self.hold = 0, self.hold_s
            return
        self.slow_in_a_row += 1
        # Two slow steps in a row to start holding; one when the team was just tried again after a hold.
        if self.slow_in_a_row >= (1 if self.hold > self.hold_s else 2):
            self.switches += 1
            self.slow_in_a_row = 0
            self.solo_until = now + self.hold
            logger.debug("a team thread keeps losing its core: one thread for %.0f s", self.hold)
            self.hold = min(2 * self.hold, self.max_hold_s)

    def stats(self) -> dict:
        return {"steps": self.steps, "solo_steps": self.solo_steps, "switches": self.switches}


def compile_kernels(name: str, **kwargs) -> object:
    """torch's cpp_extension.load(name=name, **kwargs), safe against a build that was killed half-way.

    torch marks a build in progress with a file, BUILD_DIR/lock, which a killed build leaves behind; every
    later load of that module then waits for it forever (a server stuck at "loading" after a first start
    was interrupted). Around the load, this holds an advisory lock (fcntl) of its own, which the kernel
    releases when its holder dies: whoever holds it knows that no live tokenmill process is building, so a
    lock file still there is stale and goes."""
    import fcntl

    from torch.utils.cpp_extension import load as compile_extension

    try:
        from torch.utils.cpp_extension import _get_build_directory

        build_dir = _get_build_directory(name, verbose=False)
    except Exception:  # a torch without it: its own locking alone
        return compile_extension(name=name, **kwargs)
    with open(os.path.join(build_dir, "tokenmill-build.lock"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # a live build in another process: wait for it
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            logger.warning("removing %s, left by a kernel build that did not finish", stale)
            os.remove(stale)
        return compile_extension(name=name, **kwargs)


def build(source: str) -> object:
    """Compiles a kernel source file (this package's, or another version of it to compare against) for
    this CPU: with its AVX-512 BF16 instructions where it has them, emulated where it does not."""
    digest = hashlib.sha256()
    # Quoted includes are found beside the source first: another version's headers may sit there.
    beside = [os.path.join(os.path.dirname(os.path.abspath(source)), os.path.basename(h)) for h in _HEADERS]
    for path in [source, *(b if os.path.exists(b) else h for b, h in zip(beside, _HEADERS))]:
        with open(path, "rb") as f:
            digest.update(f.read())
    # -march=native: the build is for this CPU, so the name carries its flags as well as the sources
    # (a changed source or another CPU never meets a stale build).
    simd = simd_cflags()
    if simd is None:
        raise RuntimeError("this CPU has neither AVX-512 nor AVX2 with FMA and F16C (or simde-py is missing)")
    digest.update(" ".join(sorted(_cpu_flags()) + simd).encode())
    return compile_kernels(
        f"tokenmill_cpu_kernels_{digest.hexdigest()[:12]}", sources=[source],
        extra_cflags=["-O3", "-march=native", f"-I{_DIR}", "-fopenmp", *simd], extra_ldflags=["-fopenmp"],
        verbose=False)


def load() -> object | None:
    """The compiled kernel module, or None where it cannot be used (reason logged once)."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS"):
        return None
    if simd_cflags() is None:
        logger.info("CPU lacks AVX-512 (%s) and AVX2 (%s), or simde-py is not installed: decode uses torch's "
                    "own kernels", ", ".join(_NEEDED), ", ".join(_NEEDED_SIMDE))
        return None
    try:
        _module = build(_SOURCE)
        _module.set_plan_threads(torch.get_num_threads())
    except Exception as e:  # no compiler, no headers: the torch path still works
        logger.warning("could not build the CPU decode kernels (%s); using torch's own", str(e).splitlines()[0])
        _module = None
    else:
        from tokenmill.kernels.quant import _apply_float_rows

        _apply_float_rows(_module)
    return _module


# Row counts torch's bfloat16/half GEMM meets on the CPU: chunks of GEMM_CHUNK rows, the last padded to a multiple
# of GEMM_ROW_STEP (kernels/quant_product.h, kGemmChunk: oneDNN compiles and keeps kernels per row count).
GEMM_CHUNK, GEMM_ROW_STEP = 512, 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the kernel when the batch is small (max_gemv_rows rows at most) bf16 on the CPU, and
    in bucketed row counts where torch's GEMM would compile kernels for each new count (bf16/half on the CPU)."""
    if (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.dim() == 2 and x.device.type == "cpu"
            and _module is not None and x.shape[0] <= _module.max_gemv_rows and x.shape[1] % 32 == 0
            and (bias is None or bias.dtype == torch.bfloat16)):
        return _module.gemv_bf16(x, weight, bias)
    m = x.shape[0] if x.dim() == 2 else 0
    if (x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu" and m
            and (m > GEMM_CHUNK or m % GEMM_ROW_STEP)):
        return _bucketed_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def _bucketed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m = x.shape[0]
    out = x.new_empty((m, weight.shape[0]))
    for m0 in range(0, m, GEMM_CHUNK):
        rows = min(GEMM_CHUNK, m - m0)
        padded = -(-rows // GEMM_ROW_STEP) * GEMM_ROW_STEP
        part = x[m0:m0 + rows]
        if padded != rows:
            part = torch.cat([part, part.new_zeros((padded - rows, x.shape[1]))])
        out[m0:m0 + rows] = torch.nn.functional.linear(part, weight, bias)[:rows]
    return out


# A bfloat16 chunk's norms, gated activations and rotary embeddings go through the kernels (rms_norm_bf16,
# glu_bf16, rotary_bf16: the eager operations' roundings, one pass, both threads) where they run;
# TOKENMILL_CHUNK_OPS=torch keeps torch's own element-wise operations.
CHUNK_OPS = os.environ.get("TOKENMILL_CHUNK_OPS", "kernel") != "torch"


def chunk_ops(x: torch.Tensor) -> object | None:
    """The kernel module where x is a bfloat16 CPU tensor whose element-wise operations it takes, else None."""
    if _module is not None and CHUNK_OPS and x.dtype == torch.bfloat16 and x.device.type == "cpu":
        return _module
    return None


def _row_kernels(x: torch.Tensor) -> bool:
    """Whether the kernels take x as rows: 2-D float32 or bfloat16 on the CPU, rows of 1 to 2^31 - 1 values."""
    return (_module is not None and x.device.type == "cpu" and x.dim() == 2
            and x.dtype in (torch.float32, torch.bfloat16) and 0 < x.shape[1] < 2**31)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a 2-D float32 or bfloat16 tensor; the kernel on the CPU (torch's takes ~1 ns
    per element, ~45 us for one float32 row of a 49k vocabulary, ~180 us in bfloat16)."""
    if _row_kernels(x):
        return _module.argmax_rows(x)
    return x.argmax(dim=-1)


# TOKENMILL_SAMPLER=torch keeps the sampler's torch path on the CPU too (the kernel's reference).
SAMPLE_KERNEL = os.environ.get("TOKENMILL_SAMPLER", "kernel") != "torch"


def sampler_kernel(x: torch.Tensor) -> object | None:
    """The kernel module where it draws tokens from rows like x (2-D float32 or bfloat16 on the CPU), else None."""
    return _module if SAMPLE_KERNEL and _row_kernels(x) else None


def head_dim_ok(head_dim: int) -> bool:
    """Whether the attention kernels take this head size (multiples of 16 up to 128, and 256)."""
    return head_dim % 16 == 0 and head_dim >= 16 and (head_dim <= 128 or head_dim == 256)


def max_gemv_rows() -> int:
    """The most query rows the fused decode step runs in its one pass over the weights (8 where the
    kernels are missing: the torch path has no such limit, but its small steps are no cheaper per row)."""
    module = load()
    return module.max_gemv_rows if module is not None else 8


def max_team_rows(moe: bool = False) -> int:
    """The most query rows the fused decode step runs in one parallel region, each weight read once a step
    (fewer with a mixture of experts); max_gemv_rows() where the kernels are missing."""
    module = load()
    return module.max_team_rows(moe) if module is not None else max_gemv_rows()
