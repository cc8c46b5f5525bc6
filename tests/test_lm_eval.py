"""lm-eval scoring a multiple-choice task through the server gives what lm-eval's own hf backend gives.

lm-eval's `local-completions` model scores each choice with one /v1/completions call (`echo: true`,
`logprobs: 1`, `max_tokens: 1`, the prompt as token ids) and sums the echoed prompt logprobs of the
continuation's tokens (the last entry, the generated token, is dropped). Its default tokenizer backend
("auto") picks the `remote` one when the server answers GET /tokenizer_info and POST /tokenize, and then
tokenizes through the server (/detokenize too, when it sends text), so it needs nothing but the server: the
default model is a GGUF, with no Hugging Face folder to load a tokenizer from. The reference is lm-eval's
`hf` backend on the same GGUF, loaded by transformers. Both sides run in float32: the server with `--dtype float32`, the
reference with transformers' float32 dequantization of the same GGUF, so per-choice loglikelihoods agree to
float32 rounding, not to bf16's.

lm-eval runs in a child process whose environment allows no network beyond 127.0.0.1 (offline flags for
the hub and datasets, an empty hub cache, and a proxy that refuses everything else).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server_utils import ServerProcess

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TASK_DIR = REPO / "tests" / "data" / "lm_eval"
TASK = "tokenmill_mc"
N_ITEMS = 20
SERVED_NAME = "smollm2-lm-eval"
API_KEY = "lm-eval-key"

# Per-choice loglikelihood tolerance. Both sides compute in float32 from the same dequantized weights and
# differ only in the order of float32 sums (batch shapes, kernels), which moves a logit by ~1e-6..1e-4 after
# 30 layers; a choice is 1-3 tokens, each a log-softmax of such logits (seen: ~1e-5 at most). 1e-3 leaves
# room for other CPUs' kernels and is still far below bf16's ~1e-1 and the gaps that decide the answers. A
# server that scores the wrong positions, drops a continuation token or returns the generated token's
# logprob is off by whole nats.
LL_ATOL = 1e-3


def _evaluate(args: dict) -> dict:
    """Run in the child: both lm-eval models on the local task; accuracies and per-choice loglikelihoods.

    The reference runs first, while the parent starts the server; the server's URL then arrives on stdin.
    """
    import lm_eval
    import torch
    from lm_eval.api.registry import get_model
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    # Only the local task: indexing lm-eval's thousands of built-in task files would cost tens of seconds.
    tasks = TaskManager(include_path=args["task_dir"], include_defaults=False)

    def run(lm) -> dict:
        start = time.perf_counter()
        out = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=tasks, log_samples=True,
                                      bootstrap_iters=0)
        metrics = out["results"][TASK]
        return {"acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"],
                "ll": {str(s["doc_id"]): [float(r[0]) for r in s["filtered_resps"]] for s in out["samples"][TASK]},
                "seconds": time.perf_counter() - start}

    # The reference loads the GGUF once (transformers dequantizes it to float32) and hands lm-eval the model,
    # which is what `--model hf --model_args pretrained=<folder>,gguf_file=<name>,dtype=float32` builds.
    start = time.perf_counter()
    folder, name = os.path.split(args["gguf"])
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    load = time.perf_counter() - start
    results = {"hf": run(HFLM(pretrained=model, tokenizer=tokenizer, device="cpu", batch_size=args["batch_size"]))}
    results["hf"]["load_seconds"] = load

    url = sys.stdin.readline().strip()
    # No tokenizer_backend: lm-eval's default ("auto") must find the server's remote tokenizer by itself.
    api = get_model("local-completions")(model=SERVED_NAME, base_url=url + "/v1/completions", auth_token=API_KEY,
                                         max_retries=1, batch_size=args["batch_size"])
    results["server"] = run(api)
    results["server"]["tokenizer_backend"] = api.tokenizer_backend
    return results


def _offline_env(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update({
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
        "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost",
        "OPENAI_API_KEY": API_KEY,  # local-completions sends it as the bearer token of /v1/completions
        "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                                      os.environ.get("PYTHONPATH")])),
    })
    return env


def test_local_completions_matches_hf_backend(default_gguf, tmp_path):
    args = {"gguf": default_gguf, "task_dir": str(TASK_DIR), "batch_size": 16}
    result_file, log_file = tmp_path / "result.json", tmp_path / "lm_eval.log"
    with open(log_file, "w") as log:
        child = subprocess.Popen([sys.executable, __file__, json.dumps(args), str(result_file)], cwd=REPO,
                                 env=_offline_env(tmp_path), stdin=subprocess.PIPE, stdout=log, stderr=log, text=True)
    try:
        # The reference path (weights dequantized to float32), so lm-eval's hf backend must agree to 1e-5.
        server = ServerProcess(default_gguf, "--dtype", "float32", "--quantization", "none",
                               "--served-model-name", SERVED_NAME, "--api-key", API_KEY)
        try:
            child.communicate(server.url + "\n", timeout=600)
            # What lm-eval's remote tokenizer reads, behind the API key like /tokenize.
            assert httpx.get(server.url + "/tokenizer_info").status_code == 401
            info = httpx.get(server.url + "/tokenizer_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()
            max_len = httpx.get(server.url + "/v1/models",
                                headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]["max_model_len"]
        finally:
            assert server.stop() == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, log_file.read_text()[-8000:]
    assert (info["eos_token"], info["bos_token"], info["model_max_length"]) == ("<|im_end|>", "<|im_start|>", max_len)
    assert "<|im_start|>" in info["chat_template"] and info["tokenizer_class"]
    res = json.loads(result_file.read_text())
    srv, ref = res["server"], res["hf"]
    assert srv["tokenizer_backend"] == "remote"
    print(f"server acc {srv['acc']:.2f} acc_norm {srv['acc_norm']:.2f} ({srv['seconds']:.1f} s); "
          f"hf acc {ref['acc']:.2f} acc_norm {ref['acc_norm']:.2f} ({ref['seconds']:.1f} s + "
          f"{ref['load_seconds']:.1f} s load)")

    assert sorted(ref["ll"], key=int) == [str(i) for i in range(N_ITEMS)] and sorted(srv["ll"]) == sorted(ref["ll"])
    # The reference must tell the choices apart, or equal accuracies would prove nothing.
    assert ref["acc"] >= 0.5
    diffs = {doc: max(abs(a - b) for a, b in zip(srv["ll"][doc], ref["ll"][doc], strict=True)) for doc in ref["ll"]}
    worst = max(diffs, key=diffs.get)
    print(f"largest per-choice loglikelihood difference {diffs[worst]:.2e} (item {worst})")
    assert abs(srv["acc"] - ref["acc"]) <= 1 / N_ITEMS + 1e-9
    assert abs(srv["acc_norm"] - ref["acc_norm"]) <= 1 / N_ITEMS + 1e-9
    assert diffs[worst] <= LL_ATOL, (worst, srv["ll"][worst], ref["ll"][worst])


if __name__ == "__main__":
    _args, _out = json.loads(sys.argv[1]), sys.argv[2]
    with open(_out, "w") as f:
        json.dump(_evaluate(_args), f)
