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
