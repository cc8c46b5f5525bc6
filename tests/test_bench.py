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


def test_compare_runs_each_engine_on_the_workload(tiny_models, tmp_path):
    """bench compare: transformers' static batches produce every requested token (left-padded prompts give
    the same greedy tokens as each prompt alone), and the command writes a figure per engine and workload."""
    import json
    import subprocess
    import sys

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

    out = tmp_path / "compare.json"
    proc = subprocess.run([sys.executable, "-m", "tokenmill.cli", "bench", "compare", folder, "--dtype", "float32",
                           "--workloads", "decode,prefill,throughput", "--repeats", "1", "--decode-tokens", "4",
                           "--prefill-len", "16", "--num-prompts", "6", "--input-len", "4-12", "--output-len", "2-6",
                           "--hf-batch-size", "4", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"decode", "prefill", "throughput"}
    assert all(set(figures) == {"tokenmill", "transformers"} and min(figures.values()) > 0
               for figures in results.values())
