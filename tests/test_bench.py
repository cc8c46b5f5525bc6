"""The benchmark tools count what they claim to count (no timing is asserted)."""

from __future__ import annotations

import asyncio

import pytest

from tests.server_utils import ServerProcess
from tokenmill import LLM
from tokenmill.bench.datasets import chat_requests, parse_range, percentiles, random_requests
from tokenmill.bench.offline import run_latency, run_throughput
from tokenmill.bench.serve import RequestResult, parse_goodput, run_load, summarize


def test_offline_throughput_and_latency_count_tokens(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32")
    reqs = random_requests(10, (3, 20), (2, 9), llm.engine.vocab_size, seed=3)
    r = run_throughput(llm, reqs)
    assert r["output_tokens"] == sum(q.output_len for q in reqs)
    assert r["input_tokens"] == sum(len(q.prompt_ids) for q in reqs)
    lat = run_latency(llm, batch_size=3, input_len=8, output_len=5, iters=2, warmup=1)
    assert lat["ttft_s"]["p50"] <= lat["e2e_s"]["p50"] and lat["tpot_s"]["mean"] > 0


def test_latency_samples_at_the_temperature_asked(tiny_models):
    """bench latency --temperature --top-p: the batch's tokens are drawn at that temperature and nucleus
    (the sampler sees them), not chosen greedily."""
    llm = LLM(tiny_models["llama"], dtype="float32")
    runner = llm.engine.runner
    real, seen = runner.sampler, []

    def spy(logits, reqs):
        seen.extend((r.sampling_params.temperature, r.sampling_params.top_p) for r in reqs)
        return real(logits, reqs)

    runner.sampler = spy
    lat = run_latency(llm, batch_size=2, input_len=6, output_len=4, iters=1, warmup=0, temperature=0.7, top_p=0.9)
    assert lat["temperature"] == 0.7 and len(seen) == 2 * 4 and set(seen) == {(0.7, 0.9)}


def test_chat_dataset_uses_template(tiny_models):
    tok = LLM(tiny_models["qwen3"], dtype="float32").get_tokenizer()
    reqs = chat_requests(4, tok, (5, 5), seed=1)
    assert all(r.prompt_text.endswith("<|im_start|>assistant\n") and r.output_len == 5 for r in reqs)


@pytest.mark.slow
def test_bench_serve_against_a_real_server(tiny_models):
    srv = ServerProcess(tiny_models["llama"], "--dtype", "float32")
    try:
        reqs = random_requests(12, (4, 30), (3, 8), 400, seed=5)
        results, elapsed = asyncio.run(run_load(srv.url, reqs, request_rate=50.0, max_concurrency=4,
                                                show_progress=False))
        s = summarize(results, elapsed, goodput={"ttft": 60_000, "e2el": 60_000})
        assert s["completed"] == 12 and s["failed"] == 0
        assert s["total_output_tokens"] == sum(r.output_len for r in reqs)
        assert s["goodput"] == pytest.approx(s["request_throughput"])
        assert s["ttft_ms"]["p50"] <= s["e2el_ms"]["p50"]
    finally:
        assert srv.stop() == 0


def test_summary_definitions():
    ok = RequestResult(ok=True, prompt_len=5, output_tokens=11, ttft=0.5, e2e=1.5, itl=[0.1] * 10)
    assert ok.tpot == pytest.approx(0.1)  # (e2e - ttft) / (output tokens - 1)
    bad = RequestResult(ok=False, prompt_len=5, error="HTTP 500")
    s = summarize([ok, bad], elapsed=2.0, goodput={"tpot": 50})
    assert s["completed"] == 1 and s["failed"] == 1 and s["goodput"] == 0.0  # 100 ms TPOT misses 50 ms
    assert s["output_throughput"] == pytest.approx(5.5)
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])
    with pytest.raises(ValueError):
        parse_range("9-3")
    assert percentiles([1.0, 2.0, 3.0])["p50"] == 2.0


@pytest.mark.parametrize("arch", ["llama", "llama3-tied"])
def test_roofline_counts_the_bytes_each_token_reads(tiny_models, arch):
    """Bytes per decoded token are the model's parameters as transformers counts them (a tied embedding
    once, an untied one as one looked-up row plus the output layer), and the decode share is computed
    from each run's own rate and the bandwidth measured around it."""
    from transformers import AutoModelForCausalLM

    from tokenmill.bench.roofline import run_roofline, weight_bytes

    llm = LLM(tiny_models[arch], dtype="bfloat16")
    model = llm.engine.model
    ref = AutoModelForCausalLM.from_pretrained(tiny_models[arch])
    hidden, vocab = ref.config.hidden_size, ref.config.vocab_size
    expected = ref.num_parameters() if arch == "llama3-tied" else ref.num_parameters() - (vocab - 1) * hidden
    assert weight_bytes(model) == 2 * expected
    r = run_roofline(llm, context=8, prompt_len=16, repeats=3)
    assert len(r["decode_pct_of_roofline_runs"]) == 3
    assert r["decode_pct_of_roofline"] == pytest.approx(sorted(r["decode_pct_of_roofline_runs"])[1])
    low, high = r["memory_bandwidth_range_GBps"]
    assert 0 < low <= high == r["memory_bandwidth_GBps"]
    assert r["decode_achieved_GBps"] == pytest.approx(r["decode_tokens_per_s"] * r["decode_bytes_per_token_MB"] / 1e3)
    assert r["decode_pct_of_best_bandwidth"] == pytest.approx(
        100 * r["decode_achieved_GBps"] / r["memory_bandwidth_GBps"])


FAKE_LLAMA_BENCH = """#!{python}
# Stands in for llama.cpp's llama-bench: logs its arguments, prints a JSON array shaped like `-o json`.
import json, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
opt = dict(zip(args[::2], args[1::2]))
n_prompt, n_gen, n_depth = int(opt["-p"]), int(opt["-n"]), int(opt.get("-d", 0))
with open({log!r}) as f:
    calls = [json.loads(line) for line in f]
same = sum(1 for a in calls if dict(zip(a[::2], a[1::2])).get("-p") == opt["-p"]
           and dict(zip(a[::2], a[1::2])).get("-n") == opt["-n"])
figures = {figures!r}["tg" if n_gen else "pp"]
ts = figures[(same - 1) % len(figures)]
tokens = n_gen or n_prompt
print("load_backend: loaded CPU backend", file=sys.stderr)
print(json.dumps([{{
    "build_commit": "fake123", "build_number": 1, "cpu_info": "fake CPU", "gpu_info": "", "backends": "CPU",
    "model_filename": opt["-m"], "model_type": "llama 135M Q4_1", "model_size": 85000000,
    "model_n_params": 134515008, "n_batch": 2048, "n_ubatch": 512, "n_threads": int(opt["-t"]),
    "cpu_mask": "0x0", "cpu_strict": False, "poll": 50, "type_k": "f16", "type_v": "f16", "n_gpu_layers": 99,
    "split_mode": "layer", "main_gpu": 0, "no_kv_offload": False, "flash_attn": False, "tensor_split": "0.00",
    "use_mmap": True, "embeddings": False, "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": n_depth,
    "test_time": "2025-01-01T00:00:00Z", "avg_ns": int(tokens / ts * 1e9), "stddev_ns": 0, "avg_ts": ts,
    "stddev_ts": 0.0, "samples_ns": [int(tokens / ts * 1e9)], "samples_ts": [ts]}}], indent=2))
"""
# Figures the fake reports, in call order per test type (the first call of each is the warm-up round).
FAKE_FIGURES = {"tg": [1.0, 30.0, 10.0, 20.0], "pp": [2.0, 600.0, 400.0, 500.0]}


def fake_llama_bench(folder, figures=FAKE_FIGURES):
    """An executable llama-bench in folder/bin; returns (its path, the file its calls are logged to)."""
    import sys

    log = folder / "calls.jsonl"
    exe = folder / "bin" / "llama-bench"
    exe.parent.mkdir(parents=True)
    exe.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, log=str(log), figures=figures))
    exe.chmod(0o755)
    return exe, log


def logged_calls(log) -> list[list[str]]:
    import json

    return [json.loads(line) for line in log.read_text().splitlines()]


def test_llama_bench_invocation_and_figures(tmp_path, monkeypatch):
    """llama.cpp runs through llama-bench: tg after a 32-token context for decode and pp for prefill, with
    the given threads and model file, one timed repetition a round, JSON out; each figure is the median of
    avg_ts over the rounds after the warm-up round."""
    import argparse

    from tokenmill.bench import compare

    exe, log = fake_llama_bench(tmp_path)
    found, _ = compare.find_llama_bench(str(tmp_path))
    assert found == str(exe)
    assert compare.find_llama_bench(str(tmp_path / "elsewhere"))[0] is None
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))  # default folder: empty; PATH: the fake
    monkeypatch.setenv("PATH", str(exe.parent))
    assert compare.find_llama_bench()[0] == str(exe)

    llama = compare.LlamaBench(str(exe), "/models/m.gguf", threads=3)
    args = argparse.Namespace(decode_tokens=16, prefill_len=64)
    assert compare.measure([llama], "decode", 49152, 3, args) == {"llama.cpp": 20.0}
    assert compare.measure([llama], "prefill", 49152, 3, args) == {"llama.cpp": 500.0}
    calls = logged_calls(log)
    assert len(calls) == 8
    assert calls[0] == ["-m", "/models/m.gguf", "-p", "0", "-n", "16", "-d", "32", "-t", "3", "-r", "1",
                        "-o", "json"]
    assert calls[4] == ["-m", "/models/m.gguf", "-p", "64", "-n", "0", "-d", "0", "-t", "3", "-r", "1",
                        "-o", "json"]
    assert calls[:4] == [calls[0]] * 4 and calls[4:] == [calls[4]] * 4
    assert "llama 135M Q4_1" in llama.describe() and "fake123" in llama.describe()
    with pytest.raises(ValueError):
        compare.parse_llama_bench_json("error: failed to load model")


def test_transformers_runs_in_its_own_process(tiny_models):
    """The transformers runner is a child process running transformers' generate: every requested token is
    generated, the command-line form prints them as JSON, and the served form counts each request's tokens."""
    import json
    import os
    import subprocess
    import sys

    from tokenmill.bench.compare import TransformersProcess

    folder = tiny_models["llama"]
    proc = subprocess.run([sys.executable, "-m", "tokenmill.bench.hf_runner", folder, "--dtype", "float32",
                           "--threads", "1", "--prompt-len", "5", "--new-tokens", "7", "--batch-size", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    once = json.loads(proc.stdout.strip().splitlines()[-1])
    assert once["tokens"] == once["generated"] == 14 and once["threads"] == 1 and once["dtype"] == "float32"

    with TransformersProcess(folder, "float32", threads=1) as hf:
        assert hf.info["pid"] != os.getpid() and hf.info["threads"] == 1
        seconds, tokens = hf.run(random_requests(5, (3, 12), (4, 4), 400, seed=8))
        assert seconds > 0 and tokens == hf.last["generated"] == 20
        hf.batch_size = 4
        mixed = random_requests(4, (3, 12), (2, 6), 400, seed=9)
        _, tokens = hf.run(mixed)
        assert tokens == sum(r.output_len for r in mixed)
        assert hf.last["generated"] == 4 * max(r.output_len for r in mixed)  # one batch, the longest output


def test_compare_runs_each_engine_on_the_workload(tiny_models, tmp_path):
    """bench compare: transformers' static batches produce every requested token (left-padded prompts give
    the same greedy tokens as each prompt alone), and the command writes a figure per engine and workload:
    transformers from its own process, llama.cpp from llama-bench on decode and prefill."""
    import json
    import subprocess
    import sys

    import gguf
    import numpy as np
    import torch

    from tests.conftest import hf_greedy
    from tokenmill.bench.compare import TransformersRunner

    folder = tiny_models["llama"]
    reqs = random_requests(5, (3, 12), (4, 4), 400, seed=8)
    hf = TransformersRunner(folder, torch.float32, batch_size=3)
    produced = []
    real_generate = hf.model.generate
    hf.model.generate = lambda **kw: produced.append(real_generate(**kw)) or produced[-1]
    assert hf.generate(reqs) == 20
    alone, _ = hf_greedy(folder, [r.prompt_ids for r in reqs], 4)
    by_len = sorted(reqs, key=lambda r: len(r.prompt_ids))
    batched = [row[-4:].tolist() for out in produced for row in out]
    assert batched == [alone[reqs.index(r)] for r in by_len]

    exe, log = fake_llama_bench(tmp_path / "llama.cpp")
    model = tmp_path / "m.gguf"  # llama-bench's model (the fake does not read it)
    writer = gguf.GGUFWriter(str(model), "llama")
    writer.add_tensor("w", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "compare.json"
    proc = subprocess.run([sys.executable, "-m", "tokenmill.cli", "bench", "compare", folder, "--dtype", "float32",
                           "--workloads", "decode,prefill,throughput", "--repeats", "1", "--decode-tokens", "4",
                           "--prefill-len", "16", "--num-prompts", "6", "--input-len", "4-12", "--output-len", "2-6",
                           "--hf-batch-size", "4", "--llama-cpp-dir", str(tmp_path / "llama.cpp"),
                           "--llama-cpp-model", str(model), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    results = report["results"]
    assert set(results) == {"decode", "prefill", "throughput"}
    assert set(results["throughput"]) == {"tokenmill", "transformers"}
    assert all(set(results[w]) == {"tokenmill", "transformers", "llama.cpp"} for w in ("decode", "prefill"))
    assert all(min(figures.values()) > 0 for figures in results.values())
    assert results["decode"]["llama.cpp"] == 30.0 and results["prefill"]["llama.cpp"] == 600.0
    calls = logged_calls(log)
    assert [c[c.index("-n") + 1] for c in calls] == ["4", "4", "0", "0"]
    assert [c[c.index("-p") + 1] for c in calls] == ["0", "0", "16", "16"]
    assert all(c[c.index("-m") + 1] == str(model) and c[c.index("-t") + 1] == str(report["threads"])
               for c in calls)
    assert "llama 135M Q4_1" in report["engines"]["llama.cpp"] and "F32 x 1" in proc.stdout
    assert "own process" in report["engines"]["transformers"]
    assert "decode: tokenmill" in proc.stdout and "llama.cpp 30.0 output tok/s" in proc.stdout


def test_compare_says_why_llama_cpp_is_left_out(tmp_path, monkeypatch):
    """Without llama-bench (or without a GGUF file to give it) llama.cpp is skipped, saying why."""
    from tokenmill.bench import compare

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    llama, note = compare.llama_cpp_peer("/m.gguf", 2, "cpu")
    assert llama is None and note.startswith("skipped: llama-bench not found")
    assert "build_llama_cpp.sh" in note and str(tmp_path / "cache" / "llama.cpp") in note
    llama, note = compare.llama_cpp_peer("/m.gguf", 2, "cpu", enabled=False)
    assert llama is None and "--no-llama-cpp" in note
    exe, _ = fake_llama_bench(tmp_path / "llama.cpp")
    llama, note = compare.llama_cpp_peer("/hf-folder", 2, "cpu", llama_cpp_dir=str(tmp_path / "llama.cpp"))
    assert llama is None and "Hugging Face folder" in note
