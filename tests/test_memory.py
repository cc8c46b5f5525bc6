"""A long-running server gives the heap pages it freed back to the OS (tokenmill.memory)."""

from __future__ import annotations

import asyncio
import struct
import subprocess
import sys

import pytest

from tokenmill import LLM, SamplingParams, memory
from tokenmill.engine import async_engine
from tokenmill.engine.async_engine import AsyncEngine

_FRAGMENTED_HEAP = r"""
import ctypes
from tokenmill.memory import release_freed_heap

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.mallopt(-3, 16 << 20)  # M_MMAP_THRESHOLD: 1 MiB blocks from the heap, as once a long prompt has passed


def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


blocks = [libc.malloc(1 << 20) for _ in range(96)]
for b in blocks:
    ctypes.memset(b, 1, 1 << 20)
for b in blocks[::2]:  # every other one: each free run lies between live blocks, where free() leaves it
    libc.free(ctypes.c_void_p(b))
before = rss_mib()
release_freed_heap()
print(before, rss_mib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or memory._malloc_trim() is None,
                    reason="glibc's malloc_trim")
def test_release_freed_heap_gives_back_free_runs_inside_the_heap():
    out = subprocess.run([sys.executable, "-c", _FRAGMENTED_HEAP], capture_output=True, text=True, check=True)
    before, after = map(float, out.stdout.split())
    assert before - after > 40, (before, after)  # 48 MiB were freed between live blocks


def test_the_engine_loop_releases_freed_heap_while_it_steps(tiny_models, monkeypatch):
    calls = []
    monkeypatch.setattr(async_engine, "release_freed_heap", lambda: calls.append(1))
    llm = LLM(tiny_models["llama"], dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    async def run(trim_interval):
        engine = AsyncEngine(llm.engine, trim_interval=trim_interval)
        engine.start()
        try:
            return [out async for out in engine.generate("r", [1, 2, 3], params)][-1]
        finally:
            engine.shutdown()

    assert len(asyncio.run(run(3600.0)).outputs[0].token_ids) == 16 and not calls  # not before its interval
    asyncio.run(run(0.0))
    assert calls  # after each of its steps (or bursts of steps), at a zero interval


_THREADS_THAT_ALLOCATE = r"""
import ctypes, importlib.util, sys, threading

spec = importlib.util.spec_from_file_location("memory", sys.argv[1])  # alone: importing tokenmill starts threads
memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory)
if sys.argv[2] == "one":
    assert memory.one_malloc_arena()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
together = threading.Barrier(5)


def work():
    block = libc.malloc(4096)
    together.wait()  # all alive at once: no thread hands its arena on to the next
    libc.free(ctypes.c_void_p(block))


threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
together.wait()
for t in threads:
    t.join()
libc.malloc_stats()  # to stderr: "Arena 0:", "Arena 1:", ...
if len(sys.argv) > 3:  # stay alive for the parent to look at the heaps, beside 64 MiB of data on a 64 MiB boundary
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = 64 << 20
    room = libc.mmap(None, 2 * size, 0, 0x22, -1, 0)  # PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS
    at = -(-room // size) * size
    libc.munmap(room, 2 * size)
    data = libc.mmap(at, size, 3, 0x22 | 0x100000, -1, 0)  # read-write, MAP_FIXED_NOREPLACE
    assert data == at
    ctypes.memset(data, 7, size)
    print("ready", flush=True)
    sys.stdin.readline()
"""


def _arenas_in(malloc_stats: str) -> int:
    """The arenas malloc_stats() reported ("Arena 0:", "Arena 1:", ...)."""
    return sum(line.startswith("Arena ") for line in malloc_stats.splitlines())


def _arenas(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _THREADS_THAT_ALLOCATE, memory.__file__, mode], capture_output=True,
                         text=True, check=True)
    return _arenas_in(out.stderr)


@pytest.mark.skipif(not sys.platform.startswith("linux") or memory._malloc_trim() is None, reason="glibc's malloc")
def test_one_malloc_arena_keeps_new_threads_on_the_main_arena():
    assert _arenas("default") >= 3  # glibc gives each new thread an arena of its own, up to 8 per CPU
    assert _arenas("one") == 1


def _glibc_heaps(pid: int) -> int:
    """The heaps of a process's other malloc arenas. glibc maps each such heap as 64 MiB on a 64 MiB boundary,
    read-write up to the heap's current size and inaccessible after it, and starts it with a header whose third
    and fourth words are that size and the part made read-write. Anonymous mappings of 64 MiB land on 64 MiB
    boundaries too now and then (the kernel aligns large ones to 2 MiB), so the header is read to tell a heap
    from a tensor."""
    maps = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            maps.append((start, end, fields[1], fields[4] == "0" and len(fields) == 5))
    heaps = 0
    with open(f"/proc/{pid}/mem", "rb") as mem:
        for (start, end, perm, anon), following in zip(maps, maps[1:] + [None]):
            if not (anon and perm.startswith("rw") and start % (64 << 20) == 0):
                continue
            span = end - start
            if following is not None and following[0] == end and following[2].startswith("---") and following[3]:
                span = following[1] - start
            if span != 64 << 20:
                continue
            mem.seek(start)
            _arena, _prev, size, protected = struct.unpack("<4Q", mem.read(32))
            heaps += protected == end - start and 0 < size <= protected  # the part made read-write so far
    return heaps


@pytest.mark.skipif(not sys.platform.startswith("linux") or memory._malloc_trim() is None, reason="glibc's malloc")
def test_the_heap_count_finds_the_arenas_of_threads():
    """_glibc_heaps, which the server test below relies on, against glibc's own count of arenas."""
    for mode in ("default", "one"):
        proc = subprocess.Popen([sys.executable, "-c", _THREADS_THAT_ALLOCATE, memory.__file__, mode, "wait"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline() == "ready\n"
            heaps = _glibc_heaps(proc.pid)
        finally:
            _, stats = proc.communicate("\n", timeout=30)
        arenas = _arenas_in(stats)
        assert heaps == arenas - 1 and arenas >= (3 if mode == "default" else 1)  # each arena but the main has a heap


@pytest.mark.skipif(not sys.platform.startswith("linux") or memory._malloc_trim() is None, reason="glibc's malloc")
def test_a_server_keeps_its_threads_on_the_main_arena(tiny_models):
    """release_freed_heap reaches all free memory of the main arena only: a server's threads (the engine's,
    the kernels', the event loop's executor) must not allocate from arenas of their own."""
    import httpx

    from tests.server_utils import ServerProcess

    srv = ServerProcess(tiny_models["llama"], "--dtype", "float32")
    try:
        def ask(i):
            body = {"prompt": "tell me " * (i + 1), "max_tokens": 8, "stream": i % 2 == 0}
            return httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(6) as pool:
            assert list(pool.map(ask, range(12))) == [200] * 12
        assert _glibc_heaps(srv.proc.pid) == 0
    finally:
        assert srv.stop() == 0
