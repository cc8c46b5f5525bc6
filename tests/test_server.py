"""The OpenAI-compatible server, driven by the official openai client and raw httpx."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.conftest import PROMPTS
from tests.server_utils import ServerProcess
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_models):
    srv = ServerProcess(tiny_models["llama"], "--dtype", "float32", "--served-model-name", "tiny")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32")


def sse_events(response: httpx.Response) -> list:
    """Parse an SSE body strictly: every event is 'data: ...' followed by a blank line."""
    raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    out = []
    for e in events:
        assert e.startswith("data: "), e
        payload = e[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_completion_matches_offline(client, offline):
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0)
    ref = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20))[0]
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model == "tiny" and r.id.startswith("cmpl-") and r.object == "text_completion"


def test_batch_prompts_and_n(client):
    r = client.completions.create(model="tiny", prompt=PROMPTS[:3], max_tokens=5, n=2, temperature=0.9, seed=11)
    assert sorted(c.index for c in r.choices) == list(range(6))
    again = client.completions.create(model="tiny", prompt=PROMPTS[:3], max_tokens=5, n=2, temperature=0.9, seed=11)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == \
        [c.text for c in sorted(again.choices, key=lambda c: c.index)]


def test_token_prompt_echo_and_logprobs(client, offline):
    ids = offline.get_tokenizer().encode(PROMPTS[1])
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0, logprobs=3, echo=True)
    c = r.choices[0]
    assert c.text.startswith(PROMPTS[1])
    # One entry per prompt token (the first has no logprob), then the generated ones.
    assert len(c.logprobs.tokens) == len(ids) + 4 and c.logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs[1:])
    # The token itself and the top 3, keyed by text (tokens that decode alike share a key).
    assert c.logprobs.top_logprobs[0] is None and all(1 <= len(top) <= 4 for top in c.logprobs.top_logprobs[1:])
    assert all(b > a for a, b in zip(c.logprobs.text_offset, c.logprobs.text_offset[1:]))


def _hf_prompt_logprobs(folder: str, ids: list[int]) -> list[float]:
    """Reference: transformers' log-probability of each prompt token given the ones before it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [logprobs[i - 1, t].item() for i, t in enumerate(ids) if i > 0]


def test_echo_scores_the_prompt_like_transformers(server, client, offline, tiny_models):
    """What lm-eval's loglikelihood requests send: echo, logprobs, max_tokens 0 (or 1), token ids."""
    ids = offline.get_tokenizer().encode(PROMPTS[2])
    ref = _hf_prompt_logprobs(tiny_models["llama"], ids)
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=0, temperature=0, logprobs=1, echo=True)
    c = r.choices[0]
    assert c.text == offline.get_tokenizer().decode(ids) and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(ref, abs=2e-4)
    # Greedy check as lm-eval does it: the top entry equals the token's own logprob where it was the argmax.
    assert all(max(top.values()) >= tl - 1e-6 for top, tl in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    # With a generated token too (lm-eval's older request shape), the prompt's entries are the same.
    one = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    assert one.choices[0].logprobs.token_logprobs[:len(ids)] == lp.token_logprobs
    assert len(one.choices[0].logprobs.tokens) == len(ids) + 1
    # max_tokens 0 without echo would return nothing: refused.
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": ids, "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"

    # vLLM's prompt_logprobs field: per prompt position None, then {token id: logprob, rank, decoded_token}.
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    plp = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert [plp[i][str(t)]["logprob"] for i, t in enumerate(ids) if i] == pytest.approx(ref, abs=2e-4)
    assert all(len(d) <= 3 and any(v["rank"] == 1 for v in d.values()) for d in plp[1:])


def test_streamed_echo_and_offsets_match_the_whole_answer(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    whole = httpx.post(server.url + "/v1/completions", json={**body, "echo": True}).json()["choices"][0]
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "echo": True, "stream": True}) as r:
        events = [e for e in sse_events(r) if e != "[DONE]"]
    pieces = [e["choices"][0] for e in events]
    assert "".join(p["text"] for p in pieces) == whole["text"]
    for key in ("tokens", "text_offset"):
        assert sum((p["logprobs"][key] for p in pieces), []) == whole["logprobs"][key]
    # Logprobs to float32 rounding: while another process holds a core the step governor runs steps on
    # one thread, and torch's GEMM rounds a prompt chunk's rows differently on one thread than on two.
    streamed = sum((p["logprobs"]["token_logprobs"] for p in pieces), [])
    assert streamed[0] is None and whole["logprobs"]["token_logprobs"][0] is None
    assert streamed[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=1e-5)
    # Without echo the offsets index the prompt followed by the completion, streamed or not.
    plain = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert plain["text_offset"][0] == len(PROMPTS[0])
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as r:
        events = [e for e in sse_events(r) if e != "[DONE]"]
    assert sum((e["choices"][0]["logprobs"]["text_offset"] for e in events), []) == plain["text_offset"]


def test_continuous_usage_stats(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    for route, extra in (("/v1/completions", {}), ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                                          "content": "hi"}]})):
        payload = {**body, **extra}
        if extra:
            payload.pop("prompt")
        with httpx.stream("POST", server.url + route, json=payload) as r:
            events = [e for e in sse_events(r) if e != "[DONE]"]
        counted = [e["usage"]["completion_tokens"] for e in events if e.get("usage") and e["choices"]]
        assert counted and counted == sorted(counted) and counted[-1] == 5, route
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


def test_token_bytes_and_ids(client, offline):
    from tokenmill.server.logprobs import TokenText

    names = TokenText(offline.get_tokenizer())
    text = "Ünïcödé: café, naïve, 日本語 🙂"
    ids = offline.get_tokenizer().encode(text)
    # A token's bytes are its own raw bytes: together they are the text's UTF-8, even where a token holds
    # only part of a character (and so decodes to U+FFFD alone).
    assert b"".join(bytes(names.raw_bytes(t)) for t in ids) == text.encode()
    assert any(offline.get_tokenizer().decode([t]) == "\ufffd" for t in ids)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert all(t.token.startswith("token_id:") for t in content)
    got = [int(t.token.split(":")[1]) for t in content]
    assert [t.bytes for t in content] == [names.raw_bytes(i) for i in got]


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "Tell me about blocks"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_logprobs_stop_and_extras(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"top_k": 5, "min_tokens": 6, "ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 2 for t in content)
    text = r.choices[0].message.content
    stop = text[2:4]
    s = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       temperature=0, stop=[stop], extra_body={"min_tokens": 6, "ignore_eos": True})
    assert s.choices[0].finish_reason == "stop" and s.choices[0].message.content == text[:text.index(stop)]


def test_sse_bytes_completions(server):
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_concurrent_requests_match_offline(server, offline):
    prompts = [PROMPTS[i % len(PROMPTS)] + f" {i}" for i in range(36)]
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))

    def one(p):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0,
                                                               "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(36) as pool:
        texts = list(pool.map(one, prompts))
    assert texts == [r.outputs[0].text for r in refs]


def test_errors_have_openai_shape(server):
    def check(r, status, kind):
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == kind
        assert "Traceback" not in err["message"] and "/" not in err["message"].split(" ")[0]
        return err

    url = server.url
    check(httpx.post(url + "/v1/completions", json={"prompt": "x", "temperature": 5}), 400, "invalid_request_error")
    check(httpx.post(url + "/v1/completions", json={"max_tokens": 3}), 400, "invalid_request_error")
    err = check(httpx.post(url + "/v1/completions", content=b'{"prompt": "x",\n "max_tokens": }',
                           headers={"content-type": "application/json"}), 400, "invalid_request_error")
    assert err["param"] is None and "not valid JSON" in err["message"] and "character 31" in err["message"]
    # A lone surrogate is valid JSON but no text: a 400 naming the field, and the connection stays usable.
    with httpx.Client() as keep_alive:
        for route, body in (("/v1/completions", {"prompt": "abc \ud800 def"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc \ud800"}]})):
            err = check(keep_alive.post(url + route, content=json.dumps(body).encode(),
                                        headers={"content-type": "application/json"}), 400, "invalid_request_error")
            assert err["param"] in ("prompt", "messages") and "Unicode" in err["message"]
        assert keep_alive.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    err = check(httpx.post(url + "/v1/completions", json={"prompt": "x " * 600, "max_tokens": 10}), 400,
                "invalid_request_error")
    assert err["message"].startswith("This model's maximum context length is 512 tokens. However, you requested")
    assert err["param"] == "prompt"  # the prompt alone is too long
    err = check(httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x " * 600}]}),
                400, "invalid_request_error")
    assert err["param"] == "messages"
    err = check(httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 600}), 400,
                "invalid_request_error")
    assert err["param"] == "max_tokens"  # the prompt fits; the completion asked for is what does not
    check(httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"}), 404, "not_found_error")
    check(httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                        "chat_template": "{{ 7 }}"}), 400, "invalid_request_error")
    check(httpx.post(url + "/v1/completions", content=b"x" * (5 * 2**20), headers={"content-type": "application/json"}),
          413, "invalid_request_error")
    check(httpx.get(url + "/nowhere"), 404, "not_found_error")
    # Unknown fields are ignored, not errors.
    assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "frobnicate": 1}).status_code == 200


def test_models_tokenize_version_openapi(server, offline):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 512
    tok = httpx.post(server.url + "/tokenize", json={"prompt": PROMPTS[7]}).json()
    assert tok["tokens"] == offline.get_tokenizer().encode(PROMPTS[7])
    detok = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["prompt"] == offline.get_tokenizer().decode(tok["tokens"])
    assert httpx.get(server.url + "/version").json()["version"]
    assert "/v1/chat/completions" in httpx.get(server.url + "/openapi.json").json()["paths"]


def test_disconnect_mid_stream_frees_everything(server):
    body = {"prompt": PROMPTS[3], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.metrics()["tokenmill:num_requests_running"] == 1
    server.wait_metric("tokenmill:num_requests_running", lambda v: v == 0)
    server.wait_metric("tokenmill:kv_cache_usage_perc", lambda v: v == 0)
    assert server.metrics()["tokenmill:requests_aborted_total"] >= 1


def _send_raw(port: int, path: str, body: dict, headers: bytes = b"") -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s"
                 b"Content-Length: %d\r\n\r\n%s" % (path.encode(), headers, len(data), data))
    return sock


def test_limits_sequences_and_chunked_bodies(default_gguf):
    # The real model: the seat's holder below must outlast a burst of 24 connections, and the tiny models
    # decode their whole context (512 tokens) in about half a second (a burst on a loaded machine took longer).
    srv = ServerProcess(default_gguf, "--max-queued-requests", "8",
                        "--max-num-seqs", "1", "--max-body-bytes", "100000", "--body-read-timeout", "1")
    try:
        url = srv.url + "/v1/completions"
        # More sequences (prompts x n) than the whole queue holds: never admissible, so 400 with the reason.
        r = httpx.post(url, json={"prompt": ["a"] * 5, "n": 2, "max_tokens": 1})
        assert r.status_code == 400 and "prompts x n" in r.json()["error"]["message"]
        # One seat; a request of 8 sequences leaves 7 waiting: one more sequence fits, two do not.
        with httpx.stream("POST", url, json={"prompt": ["a"] * 4, "n": 2, "max_tokens": 400, "ignore_eos": True,
                                             "stream": True}, timeout=60) as running:
            lines = running.iter_lines()
            next(lines)
            srv.wait_metric("tokenmill:num_requests_waiting", lambda v: v == 7)
            busy = httpx.post(url, json={"prompt": "a", "max_tokens": 1, "n": 2}, timeout=10)
            assert busy.status_code == 429, busy.text
        srv.wait_metric("tokenmill:num_requests_waiting", lambda v: v == 0)
        srv.wait_metric("tokenmill:num_requests_running", lambda v: v == 0)
        assert httpx.post(url, json={"prompt": ["a"] * 4, "n": 2, "max_tokens": 1}).status_code == 200
        assert srv.metrics()["tokenmill:requests_rejected_total"] == 1

        # A burst of simultaneous requests while the seat is taken: exactly the queue's 8 are admitted.
        with httpx.stream("POST", url, json={"prompt": "a", "max_tokens": 2000, "ignore_eos": True, "stream": True},
                          timeout=60) as running:
            lines = running.iter_lines()
            next(lines)
            with ThreadPoolExecutor(24) as pool:
                codes = list(pool.map(lambda i: httpx.post(url, json={"prompt": f"b {i}", "max_tokens": 1},
                                                           timeout=120).status_code, range(24)))
        assert sorted(codes) == [200] * 8 + [429] * 16, codes
        assert srv.metrics()["tokenmill:requests_rejected_total"] == 1 + 16

        def chunks():  # no Content-Length: sent with chunked transfer encoding
            yield b'{"prompt": "'
            for _ in range(30):
                yield b"x" * 10000
            yield b'", "max_tokens": 1}'

        r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text
        small = httpx.post(url, content=iter([b'{"prompt": "hi", ', b'"max_tokens": 1}']),
                           headers={"content-type": "application/json"})
        assert small.status_code == 200, small.text

        # A client that sends the headers and half its body, then stalls: 408 after the body timeout, and
        # the connection is closed instead of held.
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", srv.port)) as stalled:
            stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            stalled.settimeout(10)
            answer = b""
            while chunk := stalled.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b'"code": 408' in answer, answer
        assert 0.9 < time.monotonic() - start < 5
        assert httpx.post(url, json={"prompt": "a", "max_tokens": 1}).status_code == 200
    finally:
        assert srv.stop() == 0


def _read_all(sock: socket.socket, timeout: float = 15) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_connection_cap_and_slow_headers(tiny_models):
    """Connections past --max-connections get a 503 and are closed at once; connections whose request
    headers do not arrive (idle, or a slowloris sending half its headers) get a 408 after the read timeout
    and are closed, so that neither can hold the server's file descriptors."""
    srv = ServerProcess(tiny_models["llama"], "--dtype", "float32", "--max-connections", "3",
                        "--body-read-timeout", "2")
    try:
        held = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(3)]
        held[0].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # half its headers, then nothing
        opened = time.monotonic()
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", srv.port)) as extra:
            answer = _read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503") and b"too many open connections" in answer, answer
        assert time.monotonic() - opened < 1.5
        for sock in held:
            answer = _read_all(sock)
            assert answer.startswith(b"HTTP/1.1 408") and b"headers did not arrive" in answer, answer
            sock.close()
        assert 1.8 < time.monotonic() - opened < 6

        # A kept-alive connection: a quick first request, then a second whose headers trickle in a byte at a
        # time (each byte restarts uvicorn's keep-alive timer): a 408 when they are overdue all the same.
        with socket.create_connection(("127.0.0.1", srv.port)) as kept:
            kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            first = b""
            while b'"ok"' not in first:
                first += kept.recv(65536)
            assert first.startswith(b"HTTP/1.1 200"), first
            trickle = time.monotonic()
            kept.sendall(b"POST /v1/completions HTTP/1.1\r\n")
            with contextlib.suppress(OSError):
                for _ in range(16):
                    time.sleep(0.5)
                    kept.sendall(b"X")
            answer = _read_all(kept)
        assert answer.startswith(b"HTTP/1.1 408") and b"headers did not arrive" in answer, answer
        assert 1.8 < time.monotonic() - trickle < 6
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200
        text = httpx.get(srv.url + "/metrics").text
        assert 'tokenmill:connections_refused_total{model_name="llama",reason="max_connections"} 1.0' in text, text
        assert 'tokenmill:connections_refused_total{model_name="llama",reason="header_timeout"} 4.0' in text, text
    finally:
        assert srv.stop() == 0


def _request_on(sock: socket.socket, path: str = "/health") -> bytes:
    """One GET on a kept-alive connection; the whole response (its body is a small JSON object)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    sock.settimeout(15)
    answer = b""
    while not answer.endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        answer += chunk
    return answer


def test_kept_alive_connection_outlives_clients_pool_expiry(server):
    """httpx (and so the openai client) keeps an idle connection for 5 s. A server that closed idle
    connections after 5 s too would close each one just before its client gives it up: a request sent at that
    moment meets a closing connection and fails with a read error. The server must keep them longer."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        assert _request_on(sock).startswith(b"HTTP/1.1 200")
        time.sleep(5.5)
        answer = _request_on(sock)
    assert answer.startswith(b"HTTP/1.1 200"), answer


def test_idle_connection_gives_way_at_the_cap(tiny_models):
    """At --max-connections, a new connection closes the kept-alive connection idle the longest instead of
    getting a 503; connections in the middle of a request are never closed for it."""
    srv = ServerProcess(tiny_models["llama"], "--dtype", "float32", "--max-connections", "3")
    try:
        first, second = (socket.create_connection(("127.0.0.1", srv.port)) for _ in range(2))
        for sock in (first, second):
            assert _request_on(sock).startswith(b"HTTP/1.1 200")
            time.sleep(0.1)
        busy = socket.create_connection(("127.0.0.1", srv.port))
        busy.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # mid-request: half its headers
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", srv.port)) as newcomer:
            assert _request_on(newcomer).startswith(b"HTTP/1.1 200")
        assert _read_all(first, timeout=5) == b""  # closed, without a response
        assert _request_on(second).startswith(b"HTTP/1.1 200")  # still open
        text = httpx.get(srv.url + "/metrics").text
        assert 'tokenmill:connections_closed_idle_total{model_name="llama"} 1.0' in text, text
        assert "connections_refused_total" not in text or 'reason="max_connections"} 1.0' not in text
        for sock in (first, second, busy):
            sock.close()
    finally:
        assert srv.stop() == 0


def test_prefix_cache_reported(server):
    long_prompt = " ".join(PROMPTS) * 2
    body = {"prompt": long_prompt, "max_tokens": 2, "temperature": 0}
    httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    m = server.metrics()
    assert m["tokenmill:prefix_cache_hits_total"] >= 16
    assert m["tokenmill:prefix_cache_queries_total"] >= m["tokenmill:prefix_cache_hits_total"]
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.fixture(scope="module")
def real_server(default_gguf):
    """The real default model, one seat, a queue of one, an API key. It decodes slowly enough here (tens
    of ms a token) that a long request is still running while others queue or while a client leaves."""
    srv = ServerProcess(default_gguf, "--api-key", "s3cret", "--max-num-seqs", "1", "--max-queued-requests", "1")
    yield srv
    assert srv.stop() == 0


def test_api_key_queue_limit_and_queued_disconnect(real_server):
    srv = real_server
    url, auth = srv.url, {"Authorization": "Bearer s3cret"}
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(url + "/tokenize", json={"prompt": "x"}).status_code == 401
    ok = openai.OpenAI(base_url=url + "/v1", api_key="s3cret").completions.create(model=srv_name(srv), prompt="x",
                                                                                   max_tokens=1)
    assert ok.choices

    rejected = srv.metrics().get("tokenmill:requests_rejected_total", 0)
    long = {"prompt": PROMPTS[0], "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=long, headers=auth, timeout=60) as running:
        lines = running.iter_lines()  # keep the iterator: dropping it closes the stream
        next(lines)  # the one seat is taken
        # A second request waits in the queue; its client leaves while it is queued.
        with httpx.stream("POST", url + "/v1/completions", json=long, headers=auth, timeout=60):
            srv.wait_metric("tokenmill:num_requests_waiting", lambda v: v == 1)
            # The queue is full: a third is refused at once with Retry-After.
            start = time.monotonic()
            r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=auth, timeout=10)
            assert r.status_code == 429 and "retry-after" in r.headers
            assert time.monotonic() - start < 2
        srv.wait_metric("tokenmill:num_requests_waiting", lambda v: v == 0)
    srv.wait_metric("tokenmill:num_requests_running", lambda v: v == 0)
    srv.wait_metric("tokenmill:kv_cache_usage_perc", lambda v: v == 0)
    assert srv.metrics()["tokenmill:requests_rejected_total"] == rejected + 1


def test_disconnect_non_streaming_aborts_at_once(real_server):
    """A client waiting for a whole answer leaves while its request decodes (output never pauses, so
    only the connection tells): the request is aborted within a second and a half, long before its
    max_tokens, and its blocks are freed. The real model takes seconds for the tokens asked; a tiny one
    could finish them before any disconnect check."""
    srv, asked = real_server, 480
    for path, body in (("/v1/completions", {"prompt": "A"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "A"}]})):
        before = srv.metrics()
        sock = _send_raw(srv.port, path, {**body, "max_tokens": asked, "temperature": 0, "ignore_eos": True},
                         headers=b"Authorization: Bearer s3cret\r\n")
        srv.wait_metric("tokenmill:generation_tokens_total",
                        lambda v: v > before.get("tokenmill:generation_tokens_total", 0) + 20)
        sock.close()  # the client leaves without reading the answer
        left = time.monotonic()
        srv.wait_metric("tokenmill:requests_aborted_total",
                        lambda v: v == before.get("tokenmill:requests_aborted_total", 0) + 1, timeout=5)
        assert time.monotonic() - left < 1.5, path
        srv.wait_metric("tokenmill:num_requests_running", lambda v: v == 0)
        srv.wait_metric("tokenmill:kv_cache_usage_perc", lambda v: v == 0)
        after = srv.metrics()
        generated = after["tokenmill:generation_tokens_total"] - before.get("tokenmill:generation_tokens_total", 0)
        assert generated < asked / 2, (path, generated)


def srv_name(srv) -> str:
    return httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer s3cret"}).json()["data"][0]["id"]


def test_sigterm_cuts_off_requests_in_their_response_shapes(default_gguf, tmp_path):
    """At SIGTERM, requests still running when --shutdown-timeout ends get an error in the shape the API
    promises: a 503 JSON body for a whole answer, an SSE error event and [DONE] for a stream. No traceback
    is logged and the process exits 0."""
    log = tmp_path / "server.log"
    srv = ServerProcess(default_gguf, "--shutdown-timeout", "2", log_path=str(log))
    url = srv.url + "/v1/completions"
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    results = {}

    def whole():
        r = httpx.post(url, json=body, timeout=60)
        results["whole"] = (r.status_code, r.json())

    def streamed():
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            results["stream"] = (r.status_code, [line for line in r.iter_lines() if line])

    threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    srv.wait_metric("tokenmill:num_requests_running", lambda v: v == 2, timeout=30)
    srv.wait_metric("tokenmill:generation_tokens_total", lambda v: v >= 10, timeout=30)
    start = time.monotonic()
    assert srv.stop(signal.SIGTERM, timeout=30) == 0
    took = time.monotonic() - start
    for t in threads:
        t.join(10)
    assert 1.5 < took < 6, took  # the drain timeout, not uvicorn's cancellation after it

    status, answer = results["whole"]
    assert status == 503 and answer["error"]["type"] == "server_shutdown", answer
    status, lines = results["stream"]
    assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2][len("data: "):])
    assert error["error"]["type"] == "server_shutdown" and error["error"]["code"] == 503, error
    tokens = [json.loads(line[6:]) for line in lines[:-2]]
    assert len(tokens) >= 5 and all(chunk["choices"] for chunk in tokens)  # it streamed until the cut
    logged = log.read_text()
    assert "Traceback" not in logged and "CancelledError" not in logged, logged
    assert "stopped 2 request(s) still in flight" in logged, logged


def test_engine_death_fails_fast_and_exits_nonzero(tiny_models):
    srv = ServerProcess(tiny_models["llama"], "--dtype", "float32",
                        env={"TOKENMILL_INJECT_ENGINE_FAILURE_AFTER_STEPS": "3"})
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 50, "ignore_eos": True},
                       timeout=10)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        srv.proc.wait(15)
        assert srv.proc.returncode not in (0, None)
    finally:
        srv.stop()
