"""Benchmark workloads: random lengths, a synthetic chat-like mix, or a JSONL file of prompts."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

_CHAT_TOPICS = ["the history of Rome", "how vaccines work", "a recipe for bread", "sorting algorithms",
                "the water cycle", "learning a language", "black holes", "saving money", "writing a resume",
                "the French revolution", "photosynthesis", "neural networks", "climate change", "chess openings"]
_CHAT_ASKS = ["Explain {t} to a beginner.", "Write a short poem about {t}.", "Give me five facts about {t}.",
              "Summarise {t} in one paragraph.", "What are common misconceptions about {t}?",
              "Compare two views on {t} and conclude."]


@dataclass(slots=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int
    prompt_text: str | None = None


def random_requests(n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                    seed: int = 0) -> list[BenchRequest]:
    """Random token prompts with lengths drawn uniformly from the given inclusive ranges."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(*input_len)
        out.append(BenchRequest([rng.randrange(100, vocab) for _ in range(k)], rng.randint(*output_len)))
    return out


def chat_requests(n: int, tokenizer, output_len: tuple[int, int], seed: int = 0) -> list[BenchRequest]:
    """Chat-like prompts: a system prompt shared by all, a short history, and a question."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        topic = rng.choice(_CHAT_TOPICS)
        messages = [{"role": "system", "content": "You are a concise and helpful assistant."}]
        for _ in range(rng.randint(0, 2)):
            messages.append({"role": "user", "content": rng.choice(_CHAT_ASKS).format(t=rng.choice(_CHAT_TOPICS))})
            messages.append({"role": "assistant", "content": "Here is a brief answer. " * rng.randint(3, 20)})
        messages.append({"role": "user", "content": rng.choice(_CHAT_ASKS).format(t=topic)})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(BenchRequest(tokenizer.encode(text, add_special_tokens=False), rng.randint(*output_len), text))
    return out


def jsonl_requests(path: str, tokenizer, output_len: tuple[int, int], n: int | None = None,
                   seed: int = 0) -> list[BenchRequest]:
    """One JSON object per line with "prompt" (and optionally "output_len" or "max_tokens")."""
    rng = random.Random(seed)
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            k = row.get("output_len") or row.get("max_tokens") or rng.randint(*output_len)
            out.append(BenchRequest(tokenizer.encode(row["prompt"]), int(k), row["prompt"]))
            if n is not None and len(out) >= n:
                break
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def parse_range(text: str) -> tuple[int, int]:
    """'32-512' -> (32, 512); '128' -> (128, 128)."""
    lo, _, hi = text.partition("-")
    lo_i, hi_i = int(lo), int(hi or lo)
    if lo_i < 1 or hi_i < lo_i:
        raise ValueError(f"a length range must look like 32-512 with 1 <= low <= high, got {text!r}")
    return lo_i, hi_i


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float]:
    import numpy as np

    if not values:
        return {f"p{p}": float("nan") for p in ps} | {"mean": float("nan")}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in ps}}
