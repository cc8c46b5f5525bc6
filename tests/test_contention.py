"""Sharing the CPU: the thread count follows the CPUs the process may use, and a team of threads that lags
behind a core another process holds goes on with one thread (the decode team's barrier clock, and the
engine's step governor for every step)."""

from __future__ import annotations

import json
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


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory) -> str:
    """A Llama of 19M parameters: a decode step reads 75 MB of weights, a few milliseconds, as a real
    model's step takes. The tiny fixtures' steps take 70 microseconds: a team thread woken on the busy CPU
    mostly preempts the spinning process and finishes first, so whether the team ever lags there was up
    to the scheduler (in one run of four, no step of 200 did)."""
    from transformers import LlamaConfig

    from tests.conftest import save_tiny_models

    def configs(vocab: int) -> dict:
        return {"llama": LlamaConfig(vocab_size=vocab, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)}

    return save_tiny_models(tmp_path_factory.mktemp("small"), configs)["llama"]


@pytest.mark.skipif(cpu_kernels.usable_cpus() < 2 or cpu_kernels.load() is None,
                    reason="needs two usable CPUs and the CPU kernels")
def test_a_team_lagging_behind_a_busy_core_goes_on_with_one_thread(small_llama):
    """A process spinning on one of the CPUs: the decode team's thread there waits for its core, the team
    notices (a thread spent most of a step waiting at barriers) and the next calls run on one thread."""
    assert torch.get_num_threads() >= 2
    llm = LLM(small_llama, dtype="float32", kv_cache_memory="8MiB")
    params = SamplingParams(max_tokens=200, temperature=0.8, seed=0, ignore_eos=True)
    governor = llm.engine.runner.governor
    switches = governor.switches  # from before the warm-up: other load on the machine may switch it there
    llm.generate([[1, 2, 3]], params, use_tqdm=False)
    fused = llm.engine.model._fused[1]
    calls, solo, lagged, _ = fused.team_stats()
    held = governor.solo_steps
    spin = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{CPUS[-1]}}})\nwhile True: pass"])
    try:
        out = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0]
    finally:
        spin.kill()
        spin.wait()
    calls2, solo2, lagged2, _ = fused.team_stats()
    assert len(out.token_ids) == 200 and calls2 - calls >= 199
    # The team's own barrier clock or the step governor (whichever sees it first) notices, and the steps
    # go on with one thread.
    noticed = (lagged2 - lagged) + (governor.switches - switches)
    one_thread = (solo2 - solo) + (governor.solo_steps - held)
    # Two lagging steps in a row suffice, and one thread then runs until the end (the governor holds it
    # for a second, the team for 64 calls at a time): 196 or 197 of the 200 steps in the runs seen.
    assert noticed >= 1 and one_thread >= 150, (calls2 - calls, solo2 - solo, lagged2 - lagged, governor.stats())


@pytest.mark.skipif(cpu_kernels.load() is None, reason="needs the CPU kernels")
def test_a_team_goes_on_with_one_thread_after_two_lagging_calls_in_a_row(tiny_models):
    """The team's rule on made-up lags: one call in which a thread waited most of the time at barriers
    (a paused virtual CPU, an interrupt: seen on a quiet machine) changes nothing; two in a row send the
    next 64 calls to one thread."""
    llm = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory="8MiB")
    llm.generate([[1, 2]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    fused = llm.engine.model._fused[1]
    fused.note_lag(0.9)  # as a real call may have lagged on a loaded machine: run_solo starts the count afresh
    fused.run_solo(0, adaptive=True)
    _, _, lagged, _ = fused.team_stats()
    for lag in (0.9, 0.2, 0.9, 0.5, 0.9):  # lagging calls, never two in a row (0.5 is not lagging)
        fused.note_lag(lag)
        assert fused.solo_left() == 0, lag
    fused.note_lag(0.8)
    assert fused.solo_left() == 64
    _, _, lagged2, last = fused.team_stats()
    assert lagged2 - lagged == 4 and last == 0.8
    fused.run_solo(0, adaptive=False)  # a fixed team (for comparisons) never switches
    for _ in range(3):
        fused.note_lag(0.9)
    assert fused.solo_left() == 0
    fused.run_solo(0, adaptive=True)


@pytest.mark.skipif(len(CPUS) < 2 or cpu_kernels.load() is None, reason="needs two CPUs and the CPU kernels")
def test_one_thread_gives_the_teams_numbers(tiny_models):
    """Going on with one thread must not change what a step computes (outputs may not depend on whether
    another process held a core): the same logprobs, bit for bit, and the same greedy tokens in bursts,
    for a context long enough that the team splits its attention over the threads."""
    llm = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory="8MiB", enable_prefix_caching=False)
    llm.engine.runner.governor = None  # the team's own switch alone, whatever else runs on the machine
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


def test_governor_holds_one_thread_while_a_core_is_taken():
    """The step governor's rule, on made-up clocks: two steps in which the threads waited long for a CPU
    start a hold on one thread; once the hold ends the team is tried again, and a slow try holds twice
    as long at once; a step that ran freely ends it all."""
    now, ran, waited = [0.0], [0.0], [0.0]
    gov = cpu_kernels.ThreadGovernor(2, hold_s=1.0, max_hold_s=4.0, clock=lambda: now[0],
                                     run_delay=lambda: {"1": (ran[0], waited[0])})
    before = torch.get_num_threads()

    def step(wall: float, used: float) -> int:  # used: CPU seconds the step got (two threads: 2 x wall if free)
        with gov:
            threads = torch.get_num_threads()
            now[0] += wall
            ran[0] += used
            waited[0] += threads * wall - used
        return threads

    try:
        assert step(0.1, 0.2) == 2 and step(0.1, 0.11) == 2  # free, then one slow step: no hold yet
        assert step(0.1, 0.19) == 2 and step(0.1, 0.1) == 2  # a free step in between restarts the count
        assert step(0.1, 0.1) == 2 and gov.switches == 1  # two slow steps in a row
        assert [step(0.4, 0.4) for _ in range(3)] == [1, 1, 1]  # held for 1 s
        assert step(0.5, 0.6) == 2 and gov.switches == 2  # the team again: slow, so held at once, for 2 s
        assert [step(0.5, 0.5) for _ in range(4)] == [1] * 4
        assert step(0.1, 0.2) == 2 and step(0.1, 0.1) == 2 and gov.switches == 2  # free again: back to two in a row
        assert step(0.001, 0.0) == 2 and gov.switches == 2  # too short to judge
        assert gov.stats() == {"steps": 16, "solo_steps": 7, "switches": 2}
    finally:
        torch.set_num_threads(before)


def test_governor_ignores_threads_that_wait_without_working():
    """Threads that wait for a CPU through a step but hardly run in it (a library's pool threads, woken and
    asleep again: two appear at the first steps after a load) are not contention: the team stays. The
    same waits by threads that do run are."""
    now, times = [0.0], {"main": (0.0, 0.0), "pool1": (0.0, 0.0), "pool2": (0.0, 0.0)}
    gov = cpu_kernels.ThreadGovernor(2, clock=lambda: now[0], run_delay=lambda: dict(times))
    before = torch.get_num_threads()

    def step(wall: float, pool_ran: float) -> int:
        with gov:
            threads = torch.get_num_threads()
            now[0] += wall
            main = times["main"]
            times["main"] = (main[0] + wall, main[1])
            for name in ("pool1", "pool2"):  # waited the whole step
                ran, waited = times[name]
                times[name] = (ran + pool_ran, waited + wall)
        return threads

    try:
        assert [step(0.04, 1e-5), step(0.016, 1e-5), step(0.02, 0.0)] == [2, 2, 2]
        assert gov.switches == 0
        assert [step(0.04, 0.01), step(0.04, 0.01), step(0.04, 0.01)] == [2, 2, 1]  # they ran: contention
        assert gov.switches == 1
    finally:
        torch.set_num_threads(before)


def test_governor_ignores_the_processs_other_python_threads():
    """A server's event loop, woken to stream each token, waits for a CPU through most of a decode step
    while the team holds both cores: that is no sign that the team lost one, and the team stays. The same
    waits by a thread that is not one of the process's Python threads (a pool thread of the team) are."""
    import threading

    started, stop = threading.Event(), threading.Event()
    loop = threading.Thread(target=lambda: (started.set(), stop.wait()), name="event-loop")
    loop.start()
    started.wait()
    try:
        now = [0.0]
        me, pool, other = str(threading.get_native_id()), "pool-thread", str(loop.native_id)
        times = {me: (0.0, 0.0), pool: (0.0, 0.0), other: (0.0, 0.0)}
        gov = cpu_kernels.ThreadGovernor(2, clock=lambda: now[0], run_delay=lambda: dict(times))
        before = torch.get_num_threads()

        def step(wall: float, waiter: str) -> int:  # the team runs freely; `waiter` runs 12% and waits 90%
            with gov:
                threads = torch.get_num_threads()
                now[0] += wall
                for tid in (me, pool):
                    ran, waited = times[tid]
                    times[tid] = (ran + 0.95 * wall, waited + 0.05 * wall)
                ran, waited = times[waiter]
                times[waiter] = (ran + 0.12 * wall, waited + 0.9 * wall)
            return threads

        try:
            assert [step(0.004, other) for _ in range(6)] == [2] * 6 and gov.switches == 0
            assert [step(0.004, pool) for _ in range(3)] == [2, 2, 1] and gov.switches == 1
        finally:
            torch.set_num_threads(before)
    finally:
        stop.set()
        loop.join()


def _stream(url: str, model: str, max_tokens: int) -> int:
    import httpx

    with open(os.path.join(os.path.dirname(__file__), "..", "README.md")) as f:
        prompt = f.read()[:2400]  # some 600 tokens: each decode step reads a context of that length
    body = {"model": model, "messages": [{"role": "user", "content": f"Repeat this text:\n\n{prompt}"}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    pieces = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                pieces += len(json.loads(line[6:])["choices"])
    return pieces


@pytest.mark.skipif(cpu_kernels.usable_cpus() < 2 or cpu_kernels.load() is None,
                    reason="needs two usable CPUs and the CPU kernels")
def test_a_streaming_server_keeps_its_team_and_reports_a_taken_core(default_gguf):
    """A server streaming answers one at a time on an otherwise quiet machine: its event loop, woken for
    every token, waits for a CPU through most of each decode step while the team holds both cores. That
    is no core taken by another process, and no step goes to one thread. Beside a process spinning on one
    CPU they do, and /metrics counts them."""
    from server_utils import ServerProcess

    server = ServerProcess(default_gguf)
    try:
        import httpx

        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        # Four answers without a hold, in one of three tries: now and then something else on the machine
        # (most likely the VM's own kernel threads, such as its memory monitor) takes a core for a while,
        # which the governor rightly answers with a hold. The misreading of the event loop held steps in
        # every try of four answers (1-2 holds each).
        tries, before = [], {"tokenmill:cpu_one_thread_holds_total": 0.0, "tokenmill:cpu_steps_on_one_thread_total": 0.0}
        for _ in range(3):
            assert all(_stream(server.url, model, 200) >= 200 for _ in range(4))
            quiet = server.metrics()
            tries.append({k: quiet[k] - before[k] for k in before})
            before = {k: quiet[k] for k in before}
            if not any(tries[-1].values()):
                break
        assert not any(tries[-1].values()), tries
        spin = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{CPUS[-1]}}})\nwhile True: pass"])
        try:
            assert _stream(server.url, model, 200) >= 200
        finally:
            spin.kill()
            spin.wait()
        busy = server.metrics()
        # A streamed greedy request decodes in bursts of up to 8 steps, each one call of the fused decoder
        # (and one engine step): 200 tokens are ~25 of them, of which a third or more on one thread.
        one_thread = (busy["tokenmill:cpu_steps_on_one_thread_total"]
                      + busy["tokenmill:cpu_decode_calls_on_one_thread_total"])
        assert one_thread >= 8, busy
    finally:
        server.stop()


@pytest.mark.skipif(cpu_kernels.usable_cpus() < 2, reason="needs two usable CPUs")
@pytest.mark.parametrize("quantization,length", [("none", 300), ("none", 5), ("int4", 5)])
def test_steps_on_one_thread_give_the_teams_numbers(tiny_models, quantization, length):
    """Prompt steps (the module path) and decode steps held on one thread by the governor compute what the
    team computes, bit for bit: for a short prompt too, whose few rows go through torch's float32 GEMM
    (MKL's, whose last bits follow the thread count unless its reproducible mode is on), as plain float or
    dequantized weights."""
    llm = LLM(tiny_models["llama"], dtype="float32", quantization=quantization, kv_cache_memory="8MiB",
              enable_prefix_caching=False)
    prompt = [3 + i % 300 for i in range(length)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    governor = llm.engine.runner.governor
    governor.run_delay = lambda: {}  # never sees contention: the hold is set by hand
    runs = []
    for solo in (False, True):
        governor.solo_until = float("inf") if solo else 0.0
        steps = governor.solo_steps
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert (governor.solo_steps - steps >= 20) == solo
        runs.append((out.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in out.outputs[0].logprobs],
                     [{t: lp.logprob for t, lp in d.items()} for d in out.prompt_logprobs[1:]]))
    governor.solo_until = 0.0
    assert runs[0] == runs[1]


_PREFILL_BESIDE_A_BUSY_CORE = r"""
import json, os, subprocess, sys
from tokenmill import LLM, SamplingParams
llm = LLM(sys.argv[1], kv_cache_memory="64MiB", enable_prefix_caching=False)
text = "The river bends twice before it reaches the old mill, where the water turns a wheel. " * 8
params = SamplingParams(max_tokens=1, temperature=0)  # a prompt step and nothing else
llm.generate([text], params, use_tqdm=False)
spin = subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setaffinity(0, {%d})\nwhile True: pass" % max(os.sched_getaffinity(0))])
try:
    for i in range(5):
        llm.generate([f"{i} {j} " + text for j in range(2)], params, use_tqdm=False)
finally:
    spin.kill()
    spin.wait()
print(json.dumps(llm.engine.runner.governor.stats()))
"""


@pytest.mark.skipif(cpu_kernels.usable_cpus() < 2, reason="needs two usable CPUs")
def test_prompt_steps_beside_a_busy_core_go_on_one_thread(default_gguf):
    """Prompt steps run module by module, through torch's thread team: beside a process spinning on one
    CPU, the governor sees the team's CPU time fall and holds the steps on one thread."""
    out = subprocess.run([sys.executable, "-c", _PREFILL_BESIDE_A_BUSY_CORE, default_gguf], capture_output=True,
                         text=True, check=True, timeout=300)
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats["switches"] >= 1 and stats["solo_steps"] >= 1, stats


def _barriers_a_step(model: str) -> list[tuple[int, int]]:
    """(threads, barrier waits) of three sampled decode steps (logits()) of a fresh engine, its team fixed."""
    llm = LLM(model, dtype="float32", kv_cache_memory="8MiB")
    params = SamplingParams(max_tokens=2, temperature=0.8, seed=0)
    llm.generate([[1, 2, 3]], params, use_tqdm=False)  # (builds the fused decoder)
    fused = llm.engine.model._fused[1]
    fused.run_solo(0, adaptive=False)  # a team whatever the machine's load
    teams = []
    for _ in range(3):  # the step governor may still hold a step to one thread on a loaded machine
        llm.generate([[1, 2, 3]], params, use_tqdm=False)  # the prompt, then one sampled step
        teams.append(fused.last_team())
    return teams


@pytest.mark.skipif(cpu_kernels.usable_cpus() != 2 or cpu_kernels.load() is None,
                    reason="needs two usable CPUs (a team of two) and the CPU kernels")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_decode_step_meets_five_times_a_layer(tiny_models, arch):
    """The decode team waits at five barriers a layer: after qkv (each thread norms, rotates and stores the
    heads it computed), after attention (the thread that finishes a request's last part merges it), and
    after o, gate/up and down; a branch normed before the residual (Gemma's sandwich norms) is added by
    every thread to its own copy. Each barrier waits for the slowest thread, and for one whose core another
    process holds, for the scheduler: there were seven a layer, nine with sandwich norms."""
    with open(os.path.join(tiny_models[arch], "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    teams = _barriers_a_step(tiny_models[arch])
    assert (2, 5 * layers) in teams, teams


@pytest.mark.skipif(cpu_kernels.usable_cpus() != 2 or cpu_kernels.load() is None,
                    reason="needs two usable CPUs (a team of two) and the CPU kernels")
def test_heads_that_do_not_split_evenly_are_placed_in_a_phase_of_their_own(default_gguf):
    """The default model's 15 heads (9 of q, 3 each of k and v) do not split evenly over two threads: the
    qkv rows keep their even split, and the heads are placed after a barrier of their own, six a layer."""
    teams = _barriers_a_step(default_gguf)
    assert (2, 6 * 30) in teams, teams
