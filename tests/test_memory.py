"""A long-running server gives the heap pages it freed back to the OS (tokenmill.memory)."""

from __future__ import annotations

import asyncio
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
