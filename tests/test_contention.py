"""Sharing the CPU: the thread count follows the CPUs the process may use, and a decode team that lags
behind a core another process holds goes on with one thread."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu as cpu_kernels

CPUS = sorted(os.sched_getaffinity(0))


def test_usable_cpus_follow_the_cgroup_quota(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: one thread, never throttled
    assert cpu_kernels.usable_cpus(str(v2)) == 1
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cpu_kernels.usable_cpus(str(v2)) == len(CPUS)
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_kernels.usable_cpus(str(v1)) == 1
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_kernels.usable_cpus(str(v1)) == len(CPUS)
    assert cpu_kernels.usable_cpus(str(tmp_path / "none")) == len(CPUS)


_ONE_CPU = r"""
import os, sys, torch
before = torch.get_num_threads()  # chosen while every CPU was allowed
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
from tokenmill import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory="8MiB")
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
print(before, torch.get_num_threads())
"""


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
def test_an_engine_confined_to_one_cpu_runs_one_thread(tiny_models):
    out = subprocess.run([sys.executable, "-c", _ONE_CPU, tiny_models["llama"]], capture_output=True, text=True,
                         check=True)
    before, after = map(int, out.stdout.split()[-2:])
    assert before > 1 and after == 1


@pytest.mark.skipif(len(CPUS) < 2 or cpu_kernels.load() is None, reason="needs two CPUs and the CPU kernels")
def test_a_team_lagging_behind_a_busy_core_goes_on_with_one_thread(tiny_models):
    """A process spinning on one of the CPUs: the decode team's thread there waits for its core, the team
    notices (a thread spent most of a step waiting at barriers) and the next calls run on one thread."""
    assert torch.get_num_threads() >= 2
    llm = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory="8MiB")
    params = SamplingParams(max_tokens=200, temperature=0.8, seed=0, ignore_eos=True)
    llm.generate([[1, 2, 3]], params, use_tqdm=False)
    fused = llm.engine.model._fused[1]
    calls, solo, lagged, _ = fused.team_stats()
    spin = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{CPUS[-1]}}})\nwhile True: pass"])
    try:
        out = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0]
    finally:
        spin.kill()
        spin.wait()
    calls2, solo2, lagged2, _ = fused.team_stats()
    assert len(out.token_ids) == 200 and calls2 - calls >= 199
    assert lagged2 > lagged and solo2 - solo >= 64, (calls2 - calls, solo2 - solo, lagged2 - lagged)
