"""The CPU kernels build wherever their instructions can be had: natively on AVX-512 CPUs, through SIMDe on
x86-64 CPUs with AVX2, FMA and F16C (tests/test_kernels.py and the others then check what they compute)."""

from __future__ import annotations

import os
import platform
import shutil

import pytest

from tokenmill.kernels import cpu, quant

FLAGS = cpu._cpu_flags()
AVX512 = all(f in FLAGS for f in cpu._NEEDED)
AVX2 = all(f in FLAGS for f in cpu._NEEDED_SIMDE)

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("c++") is None,
    reason="the kernels are built for x86-64 with a C++ compiler")


@pytest.mark.skipif(not (AVX512 or AVX2), reason="this CPU has neither AVX-512 nor AVX2 with FMA and F16C")
def test_kernels_build_on_this_cpu():
    """A broken build would otherwise only show as skipped kernel tests and a slow decode."""
    if cpu.os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS"):
        pytest.skip("the kernels are switched off (TOKENMILL_DISABLE_CPU_KERNELS)")
    assert cpu.load() is not None
    assert quant.load() is not None and quant.load().vectorized
    # The native build takes VNNI's byte products and AMX's int8 tiles where the CPU has them.
    native = AVX512 and not os.environ.get("TOKENMILL_KERNELS_SIMDE")
    assert quant.load().vnni == (native and "avx512_vnni" in FLAGS)
    assert quant.load().amx == (native and "amx_int8" in FLAGS and "amx_tile" in FLAGS)
    # The build is native where the CPU has AVX-512, and SIMDe's otherwise.
    through_simde = not AVX512 or bool(os.environ.get("TOKENMILL_KERNELS_SIMDE"))
    assert ("-DTOKENMILL_SIMDE" in cpu.simd_cflags()) == through_simde


def test_simde_flags_need_avx2_fma_and_f16c(monkeypatch):
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: {"sse4_2", "avx", "avx2"})  # no FMA, no F16C
    assert cpu.simd_cflags() is None
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: {"avx", "avx2", "fma", "f16c"})
    flags = cpu.simd_cflags()
    assert flags[0] == "-DTOKENMILL_SIMDE" and flags[1].startswith("-I") and "-mno-avx512f" not in flags
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: {"avx2", "fma", "f16c", *cpu._NEEDED})
    monkeypatch.delenv("TOKENMILL_KERNELS_SIMDE", raising=False)
    assert cpu.simd_cflags() == []
    monkeypatch.setenv("TOKENMILL_KERNELS_SIMDE", "1")  # the AVX2 build, asked for on an AVX-512 CPU
    flags = cpu.simd_cflags()
    assert flags[0] == "-DTOKENMILL_SIMDE" and flags[-1] == "-mno-avx512f"  # with no AVX-512 instruction


@pytest.mark.skipif(not (AVX512 or AVX2), reason="this CPU has neither AVX-512 nor AVX2 with FMA and F16C")
def test_a_build_killed_half_way_does_not_hang_later_loads():
    """torch marks a build in progress with BUILD_DIR/lock; a build killed half-way leaves it behind, and every
    later load used to wait for it forever. A fresh process now removes it (no live build holds the advisory
    lock) and loads the kernels."""
    import subprocess
    import sys

    if cpu.os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS"):
        pytest.skip("the kernels are switched off (TOKENMILL_DISABLE_CPU_KERNELS)")
    stale = [os.path.join(os.path.dirname(m.__file__), "lock") for m in (cpu.load(), quant.load())]
    try:
        for path in stale:
            open(path, "w").close()  # as a killed build leaves it
        code = ("from tokenmill.kernels import cpu, quant\n"
                "print(cpu.load() is not None, quant.load() is not None)")
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("loading the kernels waited on a build lock that no process holds")
        assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]
        assert not any(os.path.exists(p) for p in stale)
    finally:
        for path in stale:
            if os.path.exists(path):
                os.remove(path)
