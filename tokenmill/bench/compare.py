"""`bench compare`: one workload through tokenmill and through reference engines, each at its best.

References:
- Hugging Face transformers' own `generate`, in a process of its own (`python -m tokenmill.bench.hf_runner
  --serve`), same dtype and thread count as tokenmill; static batches for the throughput workload.
- llama.cpp through its own `llama-bench` binary (`-o json`), running the GGUF file tokenmill loads,
  with tokenmill's thread count: decode is its tg test after a context as long as ours, prefill its pp
  test. benchmarks/build_llama_cpp.sh builds it; without it llama.cpp is skipped.

Runs alternate between the engines (A, B, C, A, B, C, ...) after a warm-up round; each figure is the
median of the rounds, printed with tokenmill's ratio to the reference.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

from tokenmill.bench.datasets import BenchRequest, random_requests
from tokenmill.bench.hf_runner import TransformersRunner, dtype_name  # noqa: F401  (in-process runner)
from tokenmill.sampling_params import SamplingParams

DECODE_CONTEXT = 32  # prompt tokens before the decode workload's measured tokens


class TokenmillRunner:
    name = "tokenmill"

    def __init__(self, llm) -> None:
        self.llm = llm

    def generate(self, requests: list[BenchRequest]) -> int:
        """Run the requests as one workload; returns output tokens produced."""
        self.llm.engine.reset_prefix_cache()  # every run computes its prompts afresh
        params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
        outs = self.llm.generate([r.prompt_ids for r in requests], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def run(self, requests: list[BenchRequest]) -> tuple[float, int]:
        start = time.perf_counter()
        n = self.generate(requests)
        return time.perf_counter() - start, n


class TransformersProcess:
    """transformers in a child process (tokenmill.bench.hf_runner --serve); each run is timed in the child."""

    name = "transformers"

    def __init__(self, model_path: str, dtype, threads: int, device="cpu", batch_size: int = 1) -> None:
        self.batch_size = batch_size
        self.last: dict = {}
        self._log = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, "-m", "tokenmill.bench.hf_runner", "--serve", model_path,
               "--dtype", dtype_name(dtype), "--threads", str(threads), "--device", str(device)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=env)
        self.info = self._reply()["ready"]

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self._log.seek(0)
            tail = self._log.read()[-3000:]
            raise RuntimeError(f"the transformers process exited ({self.proc.returncode}):\n{tail}")
        return json.loads(line)

    def run(self, requests: list[BenchRequest]) -> tuple[float, int]:
        msg = {"prompts": [r.prompt_ids for r in requests], "output_lens": [r.output_len for r in requests],
               "batch_size": self.batch_size}
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        self.last = self._reply()  # seconds, tokens (asked for), generated (all that generate returned)
        return self.last["seconds"], self.last["tokens"]

    def generate(self, requests: list[BenchRequest]) -> int:
        return self.run(requests)[1]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def default_llama_cpp_dir() -> str:
    """Where benchmarks/build_llama_cpp.sh puts llama.cpp by default (under tokenmill's cache)."""
    from tokenmill.model.hub import cache_dir

    return os.path.join(cache_dir(), "llama.cpp")


def find_llama_bench(llama_cpp_dir: str | None = None) -> tuple[str | None, str]:
    """(path of llama-bench or None, where it was looked for). An explicit directory is the only place
    looked at; otherwise the build script's default directory, then PATH."""
    dirs = [llama_cpp_dir] if llama_cpp_dir else [default_llama_cpp_dir()]
    looked = []
    for d in dirs:
        for candidate in (os.path.join(d, "bin", "llama-bench"), os.path.join(d, "llama-bench")):
            looked.append(candidate)
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate, ", ".join(looked)
    if not llama_cpp_dir:
        looked.append("PATH")
        found = shutil.which("llama-bench")
        if found:
            return found, ", ".join(looked)
    return None, ", ".join(looked)


class LlamaBench:
    """llama.cpp's own benchmark binary on one GGUF file: one llama-bench run (its own warm-up, then one
    timed repetition) per figure."""

    name = "llama.cpp"

    def __init__(self, exe: str, gguf_path: str, threads: int, gpu_layers: int | None = None,
                 timeout: float = 900) -> None:
        self.exe, self.gguf_path, self.threads, self.gpu_layers, self.timeout = (
            exe, gguf_path, threads, gpu_layers, timeout)
        self.last: dict = {}

    def command(self, n_prompt: int, n_gen: int, n_depth: int = 0, repetitions: int = 1) -> list[str]:
        cmd = [self.exe, "-m", self.gguf_path, "-p", str(n_prompt), "-n", str(n_gen), "-d", str(n_depth),
               "-t", str(self.threads), "-r", str(repetitions), "-o", "json"]
        if self.gpu_layers is not None:
            cmd += ["-ngl", str(self.gpu_layers)]
        return cmd

    def run_test(self, n_prompt: int, n_gen: int, n_depth: int = 0, repetitions: int = 1) -> dict:
        """The llama-bench record of one test (its avg_ts is tokens per second of the timed part)."""
        cmd = self.command(n_prompt, n_gen, n_depth, repetitions)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
        records = parse_llama_bench_json(proc.stdout)
        for rec in records:
            if int(rec["n_prompt"]) == n_prompt and int(rec["n_gen"]) == n_gen:
                self.last = rec
                return rec
        raise RuntimeError(f"llama-bench printed no pp{n_prompt}/tg{n_gen} result:\n{proc.stdout[-3000:]}")

    def figure(self, workload: str, round_: int, vocab: int, args) -> float:
        if workload == "decode":
            return float(self.run_test(0, args.decode_tokens, DECODE_CONTEXT)["avg_ts"])
        if workload == "prefill":
            return float(self.run_test(args.prefill_len, 0)["avg_ts"])
        raise ValueError(f"llama-bench does not run the {workload!r} workload")

    def describe(self) -> str:
        """What the last llama-bench run reported about itself."""
        rec = self.last
        if not rec:
            return "llama-bench not run yet"
        return (f"llama-bench reported model type {rec.get('model_type', '?')!r}, backends {rec.get('backends', '?')}, "
                f"{rec.get('n_threads', '?')} threads, build {rec.get('build_commit', '?')}")


def llama_cpp_peer(model_path: str, threads: int, device, llama_cpp_dir: str | None = None,
                   gguf_path: str | None = None, enabled: bool = True) -> tuple[LlamaBench | None, str]:
    """llama.cpp's runner for the file tokenmill loads (or gguf_path), or None and why it is left out."""
    if not enabled:
        return None, "skipped (--no-llama-cpp)"
    gguf = gguf_path or (model_path if model_path.endswith(".gguf") else None)
    exe, looked = find_llama_bench(llama_cpp_dir)
    if exe is None:
        return None, (f"skipped: llama-bench not found (looked at {looked}); "
                      "build it with benchmarks/build_llama_cpp.sh or pass --llama-cpp-dir")
    if gguf is None:
        return None, ("skipped: tokenmill loads a Hugging Face folder, not a GGUF file; pass --llama-cpp-model "
                      "FILE.gguf (llama.cpp's convert_hf_to_gguf.py makes one)")
    on_gpu = getattr(device, "type", str(device)).startswith("cuda")
    llama = LlamaBench(exe, gguf, threads, gpu_layers=99 if on_gpu else None)
    return llama, f"{gguf} as stored ({gguf_weight_types(gguf)}), {threads} threads, llama-bench at {exe}"


def parse_llama_bench_json(text: str) -> list[dict]:
    """llama-bench -o json prints one JSON array of test records on stdout."""
    start = text.find("[")
    if start < 0:
        raise ValueError(f"no JSON array in llama-bench's output: {text[-500:]!r}")
    records = json.loads(text[start:])
    if not isinstance(records, list):
        raise ValueError("llama-bench's JSON output is not an array")
    return records


def gguf_weight_types(path: str) -> str:
    """The tensor types of a GGUF file, most frequent first, e.g. 'Q4_1 x 211, F32 x 61, Q8_0 x 1'."""
    from tokenmill.model.gguf_loader import GGUFFile

    counts = Counter(t.tensor_type.name for t in GGUFFile(path).tensors)
    return ", ".join(f"{name} x {n}" for name, n in counts.most_common())


def request_figure(runner, workload: str, round_: int, vocab: int, args) -> float:
    """tokens/s of one run of a workload through an engine that takes requests (tokenmill, transformers)."""
    if workload == "decode":
        prompt = random_requests(1, (DECODE_CONTEXT, DECODE_CONTEXT), (1, 1), vocab, seed=round_)[0].prompt_ids
        t1, _ = runner.run([BenchRequest(prompt, 1)])
        tn, _ = runner.run([BenchRequest(prompt, args.decode_tokens + 1)])
        return args.decode_tokens / max(tn - t1, 1e-9)
    if workload == "prefill":
        prompt = random_requests(1, (args.prefill_len, args.prefill_len), (1, 1), vocab, seed=100 + round_)[0]
        t, _ = runner.run([prompt])
        return args.prefill_len / t
    reqs = random_requests(args.num_prompts, args.input_range, args.output_range, vocab, seed=200 + round_)
    if round_ == 0:
        reqs = reqs[:8]  # a short warm-up
    t, n = runner.run(reqs)
    return n / t


def measure_samples(runners: list, workload: str, vocab: int, repeats: int, args) -> dict[str, list[float]]:
    """Every engine's figure (tokens/s) in each of `repeats` rounds after a warm-up round; within a round
    the engines run one after another in a fixed order (A, B, C, A, B, C, ...)."""
    samples: dict[str, list[float]] = {r.name: [] for r in runners}
    for i in range(repeats + 1):  # round 0 warms up
        for runner in runners:
            if hasattr(runner, "figure"):
                value = runner.figure(workload, i, vocab, args)
            else:
                value = request_figure(runner, workload, i, vocab, args)
            if i:
                samples[runner.name].append(value)
    return samples


def measure(runners: list, workload: str, vocab: int, repeats: int, args) -> dict[str, float]:
    """The median figure per engine (tokens/s) for one workload."""
    samples = measure_samples(runners, workload, vocab, repeats, args)
    return {name: statistics.median(v) for name, v in samples.items()}


def best_static_batch(runner, vocab: int, args, sizes: tuple[int, ...] | None = None,
                      on_gpu: bool = False) -> int:
    """transformers' best batch size for the throughput workload (a short sweep on a slice of it); a GPU
    is tried with larger batches."""
    if sizes is None:
        sizes = (32, 64, 128, 256) if on_gpu else (16, 32, 64)
    n = min(args.num_prompts, max(64, max(sizes)))
    reqs = random_requests(n, args.input_range, args.output_range, vocab, seed=999)
    best, best_rate = sizes[0], 0.0
    for b in sizes:
        runner.batch_size = b
        t, n = runner.run(reqs)
        if n / t > best_rate:
            best, best_rate = b, n / t
    return best
