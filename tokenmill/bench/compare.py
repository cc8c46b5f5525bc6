"""`bench compare`: one workload through tokenmill and through reference engines, A/B alternated.

References: Hugging Face transformers `generate` (always; static batches, the best batch size of a
small sweep) and llama.cpp through llama-cpp-python when it is installed. Each figure is the median
of the alternating runs, printed with tokenmill's ratio to the reference.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from tokenmill.bench.datasets import BenchRequest, random_requests
from tokenmill.sampling_params import SamplingParams


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


class TransformersRunner:
    """transformers' generate with static batches: prompts sorted by length, left-padded, batch by batch."""

    name = "transformers"

    def __init__(self, model_path: str, dtype: torch.dtype, batch_size: int = 1,
                 device: torch.device | str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        kwargs = {"dtype": dtype}
        if model_path.endswith(".gguf"):
            kwargs["gguf_file"] = os.path.basename(model_path)
            model_path = os.path.dirname(model_path) or "."
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs).to(self.device).eval()
        self.batch_size = batch_size

    @torch.inference_mode()
    def generate(self, requests: list[BenchRequest]) -> int:
        produced = 0
        order = sorted(requests, key=lambda r: len(r.prompt_ids))
        for i in range(0, len(order), self.batch_size):
            batch = order[i:i + self.batch_size]
            width = max(len(r.prompt_ids) for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for j, r in enumerate(batch):
                ids[j, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
                mask[j, width - len(r.prompt_ids):] = 1
            new = max(r.output_len for r in batch)
            self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            produced += sum(r.output_len for r in batch)  # only what each request asked for counts
        return produced


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python, one request at a time (its Python API does not batch requests)."""

    name = "llama.cpp"

    def __init__(self, gguf_path: str, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=gguf_path, n_ctx=4096, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False)

    def generate(self, requests: list[BenchRequest]) -> int:
        produced = 0
        for r in requests:
            self.llm.reset()
            self.llm.eval(r.prompt_ids)
            for _ in range(r.output_len):
                token = self.llm.sample(temp=0.0)
                self.llm.eval([token])
                produced += 1
        return produced


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _timed(runner, requests) -> tuple[float, int]:
    start = time.perf_counter()
    n = runner.generate(requests)
    return time.perf_counter() - start, n


def measure(runners: list, workload: str, vocab: int, repeats: int, args) -> dict[str, float]:
    """A figure per runner (tokens/s) for one workload, runs alternating between runners."""
    samples: dict[str, list[float]] = {r.name: [] for r in runners}
    for i in range(repeats + 1):  # run 0 warms up
        order = runners if i % 2 == 0 else list(reversed(runners))
        for runner in order:
            if workload == "decode":
                prompt = random_requests(1, (32, 32), (1, 1), vocab, seed=i)[0].prompt_ids
                t1, _ = _timed(runner, [BenchRequest(prompt, 1)])
                tn, _ = _timed(runner, [BenchRequest(prompt, args.decode_tokens + 1)])
                value = args.decode_tokens / max(tn - t1, 1e-9)
            elif workload == "prefill":
                prompt = random_requests(1, (args.prefill_len, args.prefill_len), (1, 1), vocab, seed=100 + i)[0]
                t, _ = _timed(runner, [prompt])
                value = args.prefill_len / t
            else:
                reqs = random_requests(args.num_prompts, args.input_range, args.output_range, vocab, seed=200 + i)
                if i == 0:
                    reqs = reqs[:8]  # a short warm-up
                t, n = _timed(runner, reqs)
                value = n / t
            if i:
                samples[runner.name].append(value)
    return {name: statistics.median(v) for name, v in samples.items()}


def best_static_batch(runner: TransformersRunner, vocab: int, args, sizes: tuple[int, ...] | None = None) -> int:
    """transformers' best batch size for the throughput workload (a short sweep on a slice of it); a GPU
    is tried with larger batches."""
    if sizes is None:
        sizes = (32, 64, 128, 256) if runner.device.type == "cuda" else (16, 32, 64)
    n = min(args.num_prompts, max(64, max(sizes)))
    reqs = random_requests(n, args.input_range, args.output_range, vocab, seed=999)
    best, best_rate = sizes[0], 0.0
    for b in sizes:
        runner.batch_size = b
        t, n = _timed(runner, reqs)
        if n / t > best_rate:
            best, best_rate = b, n / t
    return best
