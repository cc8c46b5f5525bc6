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


@pytest.mark.skipif(len(CPUS) < 2 or cpu_kernels.load() is None, reason="needs two CPUs and the CPU kernels")
def test_one_thread_gives_the_teams_numbers(tiny_models):
    """Going on with one thread must not change what a step computes (outputs may not depend on whether
    another process held a core): the same logprobs, bit for bit, and the same greedy tokens in bursts,
    for a context long enough that the team splits its attention over the threads."""
    llm = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory="8MiB", enable_prefix_caching=False)
    prompt = [3 + i % 300 for i in range(300)]
    sampled = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=3)  # one step at a time
    burst = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)  # greedy bursts
    runs = []
    for solo in (False, True):
        llm.generate([[1, 2]], burst, use_tqdm=False)  # the fused decoder exists from here on
        fused = llm.engine.model._fused[1]
        fused.run_solo(10 ** 6 if solo else 0, adaptive=False)
        _, solo_before, _, _ = fused.team_stats()
        out = [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0] for params in (sampled, burst)]
        _, solo_after, _, _ = fused.team_stats()
        assert (solo_after - solo_before >= 30) == solo
        runs.append([(o.token_ids, o.logprobs) for o in out])
    fused.run_solo(0, adaptive=True)
    (team_lp, team_burst), (solo_lp, solo_burst) = runs
    assert team_lp[0] == solo_lp[0]
    assert [{t: lp.logprob for t, lp in d.items()} for d in team_lp[1]] == \
        [{t: lp.logprob for t, lp in d.items()} for d in solo_lp[1]]
    assert team_burst[0] == solo_burst[0]
