"""How often the default model names Paris for "What is the capital of France?" in 20 seeded chat samples
with its built-in sampling defaults (none given), 24 tokens each: offline one request at a time (the
prefix cache on, as served), offline all 20 in one call, and through `tokenmill serve` one request at a
time: docs/benchmarks.md, "A prompt's rows on float inputs".

    python benchmarks/france_count.py                                  # a prompt's rows on float inputs
    TOKENMILL_QUANT_FLOAT_PROMPTS=0 python benchmarks/france_count.py  # by their count, as before
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tokenmill import LLM  # noqa: E402

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
SEEDS = range(20)


def count(texts: list[str]) -> int:
    return sum(bool(re.search("Paris", t)) for t in texts)


def main() -> None:
    llm = LLM()
    base = llm.get_default_sampling_params()
    one = [llm.chat([CHAT], base.clone(seed=s, max_tokens=24), use_tqdm=False)[0].outputs[0].text for s in SEEDS]
    llm.engine.reset_prefix_cache()
    params = [base.clone(seed=s, max_tokens=24) for s in SEEDS]
    batch = [o.outputs[0].text for o in llm.chat([CHAT] * len(SEEDS), params, use_tqdm=False)]
    del llm
    port = 8431
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        served = []
        for s in SEEDS:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                           json={"messages": CHAT, "seed": s, "max_tokens": 24})
            served.append(r.json()["choices"][0]["message"]["content"])
    finally:
        server.terminate()
        server.wait()
    n = len(SEEDS)
    print(f"offline, one at a time: {count(one)} of {n}; offline, one call: {count(batch)} of {n}; "
          f"server: {count(served)} of {n}")


if __name__ == "__main__":
    main()
