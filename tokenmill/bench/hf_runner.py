"""transformers' own `generate`, run in a process of its own for `bench compare`.

    python -m tokenmill.bench.hf_runner MODEL --dtype bfloat16 --threads 2 --prompt-len 32 --new-tokens 128

loads MODEL (a Hugging Face folder, or a .gguf file that transformers dequantizes), runs one greedy
`generate` of --new-tokens tokens after a random prompt of --prompt-len tokens (after a short warm-up)
and prints one JSON object (tokens, seconds, output_tokens_per_s: the whole call, prompt included).
With --serve it loads the model once, prints a JSON line {"ready": ...}, then answers each JSON line
on stdin ({"prompts": [[ids], ...], "output_lens": [...], "batch_size": b}) with a JSON
line {"seconds", "tokens", "generated"}, timed inside this process; it exits at the end of stdin.

Requests run as static batches: prompts sorted by length, left-padded, `batch_size` at a time, each batch
generating exactly the longest output asked for in it (no early stop); `tokens` counts only what each
request asked for, `generated` every token `generate` returned.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from tokenmill.bench.datasets import BenchRequest, random_requests

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, str):
        return {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype)
    return str(dtype).removeprefix("torch.")


class TransformersRunner:
    """transformers' generate with static batches: prompts sorted by length, left-padded, batch by batch."""

    name = "transformers"

    def __init__(self, model_path: str, dtype: torch.dtype | str, batch_size: int = 1,
                 device: torch.device | str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        kwargs = {"dtype": _DTYPES[dtype_name(dtype)]}
        if model_path.endswith(".gguf"):
            kwargs["gguf_file"] = os.path.basename(model_path)
            model_path = os.path.dirname(model_path) or "."
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs).to(self.device).eval()
        self.batch_size = batch_size

    @torch.inference_mode()
    def run(self, requests: list[BenchRequest]) -> tuple[float, int, int]:
        """(seconds, tokens asked for, tokens generated) for the requests as one workload."""
        counted = generated = 0
        order = sorted(requests, key=lambda r: len(r.prompt_ids))
        start = time.perf_counter()
        for i in range(0, len(order), self.batch_size):
            batch = order[i:i + self.batch_size]
            width = max(len(r.prompt_ids) for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for j, r in enumerate(batch):
                ids[j, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
                mask[j, width - len(r.prompt_ids):] = 1
            new = max(r.output_len for r in batch)
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            generated += (out.shape[1] - width) * out.shape[0]
            counted += sum(r.output_len for r in batch)  # only what each request asked for counts
        return time.perf_counter() - start, counted, generated

    def generate(self, requests: list[BenchRequest]) -> int:
        return self.run(requests)[1]


def _setup(args) -> TransformersRunner:
    if args.threads:
        torch.set_num_threads(args.threads)
    return TransformersRunner(args.model, args.dtype, batch_size=args.batch_size, device=args.device)


def _describe(runner: TransformersRunner) -> dict:
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "dtype": dtype_name(next(runner.model.parameters()).dtype), "threads": torch.get_num_threads(),
            "device": str(runner.device), "parameters": runner.model.num_parameters(), "pid": os.getpid()}


def serve(args) -> int:
    # The protocol owns the real stdout; anything the libraries print goes to stderr.
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    runner = _setup(args)
    proto.write(json.dumps({"ready": _describe(runner)}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        runner.batch_size = int(msg.get("batch_size", 1))
        reqs = [BenchRequest(list(p), int(n)) for p, n in zip(msg["prompts"], msg["output_lens"])]
        seconds, tokens, generated = runner.run(reqs)
        proto.write(json.dumps({"seconds": seconds, "tokens": tokens, "generated": generated}) + "\n")
    return 0


def once(args) -> int:
    runner = _setup(args)
    vocab = runner.model.config.vocab_size
    reqs = random_requests(args.batch_size, (args.prompt_len, args.prompt_len), (args.new_tokens, args.new_tokens),
                           vocab, seed=args.seed)
    if args.warmup:
        runner.run([BenchRequest(reqs[0].prompt_ids, 2)])
    seconds, tokens, generated = runner.run(reqs)
    print(json.dumps({**_describe(runner), "batch_size": args.batch_size, "prompt_len": args.prompt_len,
                      "tokens": tokens, "generated": generated, "seconds": seconds,
                      "output_tokens_per_s": generated / seconds}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenmill.bench.hf_runner", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="Hugging Face folder or .gguf file")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES) + ["bf16", "fp32", "fp16"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--serve", action="store_true", help="answer JSON requests on stdin (see above)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    args = p.parse_args(argv)
    return serve(args) if args.serve else once(args)


if __name__ == "__main__":
    sys.exit(main())
