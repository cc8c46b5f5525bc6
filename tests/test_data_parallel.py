"""Data parallelism: the router's choice, and a front before two replica processes (routing, failures, cleanup)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import threading
import time

import httpx
import pytest

from server_utils import ServerProcess
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.data_parallel import merge_metrics
from tokenmill.server.replicas import MAX_FAILED_STARTS, ReplicaSet
from tokenmill.server.router import PrefixRouter, RoundRobinRouter, prefix_block_hashes

BS = 16
KEY = {"authorization": "Bearer sekret"}  # the front's key; the replicas have their own


def blocks(*prefixes: int, tail: int = 0) -> list[bytes]:
    """Hashes of a prompt made of the given 16-token blocks (block k: tokens 1000k .. 1000k+15)."""
    ids = [1000 * k + j for k in prefixes for j in range(BS)]
    return prefix_block_hashes(ids + list(range(tail)), BS)


# ---------------------------------------------------------------------- the router alone
def test_block_hashes_are_the_prefix_caches():
    ids = list(range(5, 5 + 3 * BS + 7))
    for salt in (None, "tenant-a"):
        kv = KVCacheManager(8, BS)
        req = Request("r", ids, SamplingParams(cache_salt=salt), 1)
        kv._extend_hashes(req)
        assert prefix_block_hashes(ids, BS, salt) == [h.digest for h in req.block_hashes]
        assert len(req.block_hashes) == 3
    assert prefix_block_hashes(ids, BS, "a")[0] != prefix_block_hashes(ids, BS, "b")[0]


def test_longest_prefix_wins_over_load():
    router = PrefixRouter(3)
    router.record(0, blocks(1, 2))
    router.record(1, blocks(1, 2, 3))
    router.record(2, blocks(7))
    assert router.score(1, blocks(1, 2, 3, 4)) == 3
    # Replica 1 holds the longest prefix though it is the busiest.
    assert router.choose(blocks(1, 2, 3, 4), [0, 5, 0], [True] * 3) == 1
    # Blocks after a miss do not count: a prefix is a chain.
    assert router.score(1, blocks(9, 2, 3)) == 0
    # Unavailable replicas are skipped, the next longest prefix wins.
    assert router.choose(blocks(1, 2, 3, 4), [0, 0, 0], [True, False, True]) == 0


def test_ties_go_to_the_least_loaded():
    router = PrefixRouter(3)
    router.record(0, blocks(1))
    router.record(1, blocks(1))
    assert router.choose(blocks(1, 2), [4, 2, 0], [True] * 3) == 1  # 0 and 1 tie on prefix, 1 has less load
    assert router.choose(blocks(5), [4, 2, 1], [True] * 3) == 2  # no prefix anywhere: the least loaded
    assert router.choose(blocks(5), [0, 0, 0], [True] * 3) == 2  # equal load: the one holding fewest blocks


def test_balance_threshold_overrides_a_hot_prefix():
    router = PrefixRouter(2, balance_threshold=4)
    router.record(0, blocks(1))
    assert router.choose(blocks(1), [3, 0], [True, True]) == 0
    assert router.choose(blocks(1), [4, 0], [True, True]) == 1


def test_tables_are_bounded_lru_and_forgotten():
    router = PrefixRouter(1, capacity_blocks=3)
    router.record(0, blocks(1, 2))
    router.record(0, blocks(7))
    router.record(0, blocks(1))  # touched: now the most recent
    router.record(0, blocks(8))  # evicts the least recently used: block 2 of prompt (1, 2)
    assert router.score(0, blocks(1, 2)) == 1
    assert router.score(0, blocks(7)) == 1 and router.score(0, blocks(8)) == 1
    router.forget(0)
    assert router.score(0, blocks(1)) == 0
    with pytest.raises(LookupError):
        router.choose(blocks(1), [0], [False])


def test_round_robin_ignores_prefixes():
    router = RoundRobinRouter(3)
    picks = [router.choose(blocks(1), [0, 0, 0], [True, False, True]) for _ in range(4)]
    assert picks == [0, 2, 0, 2]


def test_merged_metrics_label_each_replica_once_per_family():
    text = ('# HELP tokenmill:x Things.\n# TYPE tokenmill:x counter\ntokenmill:x_total{model_name="m"} 3.0\n'
            '# HELP tokenmill:y Other.\n# TYPE tokenmill:y gauge\ntokenmill:y 1.0\n')
    merged = merge_metrics({0: text, 1: text.replace("3.0", "4.0")}).splitlines()
    assert merged.count("# TYPE tokenmill:x counter") == 1
    assert 'tokenmill:x_total{model_name="m",replica="0"} 3.0' in merged
    assert 'tokenmill:x_total{model_name="m",replica="1"} 4.0' in merged
    assert merged.index('tokenmill:y{replica="1"} 1.0') > merged.index("# TYPE tokenmill:y gauge")


def test_a_replica_that_keeps_dying_before_ready_is_removed():
    class Exited:
        returncode = 1

        def poll(self):
            return 1

    died = []
    replicas = ReplicaSet(argparse.Namespace(), 1, 1, "secret", on_death=died.append)
    r = replicas[0]
    r.status, r.proc = "ready", Exited()
    replicas._died(r, now=100.0)  # a ready replica died: restart after the first back-off
    assert (r.status, r.restart_at, r.failed_starts) == ("dead", 101.0, 0)
    delays = []
    for _ in range(MAX_FAILED_STARTS):
        r.status = "starting"  # restarted, and died again before it was ready
        replicas._died(r, now=100.0)
        delays.append(r.restart_at - 100.0)
    assert r.status == "removed" and delays[:-1] == [2.0, 4.0] and len(died) == 1 + MAX_FAILED_STARTS


# ---------------------------------------------------------------------- a front and two replicas
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Front(ServerProcess):
    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def pids(self) -> list[int]:
        return [r["pid"] for r in self.health()["replicas"]]

    def wait_all_ready(self, timeout: float = 60.0) -> dict:
        def all_ready():
            health = self.health()
            return health if all(r["status"] == "ready" for r in health["replicas"]) else None

        return _wait(all_ready, timeout, "every replica to be ready")

    def replica_metric(self, name: str, replica: int) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and f'replica="{replica}"' in line)


@pytest.fixture(scope="module")
def front(tiny_models):
    srv = Front(tiny_models["llama"], "--dtype", "float32", "--data-parallel-size", "2", "--kv-cache-memory", "4MiB",
                "--num-scheduler-steps", "1", "--served-model-name", "tiny", "--api-key", "sekret")
    seen: set[int] = set()
    try:
        srv.wait_all_ready()
        srv.seen_pids = seen
        seen.update(srv.pids())
        yield srv
    finally:
        with_pids = seen | set(_safe_pids(srv))
        assert srv.stop() == 0
        # No replica outlives the front.
        _wait(lambda: not any(_alive(p) for p in with_pids), 15, "the replicas to exit")


def _safe_pids(srv) -> list[int]:
    try:
        return [p for p in srv.pids() if p]
    except httpx.HTTPError:
        return []


def _complete(front, prompt, **kw) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, **kw}
    return httpx.post(front.url + "/v1/completions", json=body, timeout=60, headers=KEY)


def test_front_routes_by_prefix_then_load(front):
    system = [(7 * i) % 300 + 3 for i in range(4 * BS)]  # 4 full blocks shared by a "tenant"
    first = _complete(front, system + [11, 12])
    assert first.status_code == 200, first.text
    home = int(first.headers["x-tokenmill-replica"])
    hits_before = front.replica_metric("tokenmill:prefix_cache_hits_total", home)
    # The same prefix with another question goes home, and is a prefix-cache hit there.
    for question in ([21, 22, 23], [31]):
        r = _complete(front, system + question)
        assert int(r.headers["x-tokenmill-replica"]) == home
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BS
    assert front.replica_metric("tokenmill:prefix_cache_hits_total", home) >= hits_before + 8 * BS
    # A new prefix while home is busy with a long stream goes to the other (less loaded) replica.
    other = 1 - home
    with httpx.stream("POST", front.url + "/v1/completions", timeout=60, headers=KEY,
                      json={"model": "tiny", "prompt": system + [5], "max_tokens": 300, "ignore_eos": True,
                            "stream": True}) as busy:
        assert int(busy.headers["x-tokenmill-replica"]) == home
        r = _complete(front, [250 - i for i in range(3 * BS)])
        assert int(r.headers["x-tokenmill-replica"]) == other
        # The shared prefix still goes home, busy or not.
        assert int(_complete(front, system + [41]).headers["x-tokenmill-replica"]) == home
    # Chat requests are routed on the prompt the chat template renders: one long system message, one home.
    messages = [{"role": "system", "content": "You answer questions about the mill. " * 12}]
    homes = {httpx.post(front.url + "/v1/chat/completions", timeout=60, headers=KEY,
                        json={"model": "tiny", "max_tokens": 2, "messages": messages + [{"role": "user", "content": q}]}
                        ).headers["x-tokenmill-replica"] for q in ("why?", "how much flour?", "when")}
    assert len(homes) == 1
    metrics = httpx.get(front.url + "/metrics", timeout=5).text
    assert 'tokenmill:router_requests_total{model_name="tiny",replica="0"}' in metrics
    assert "tokenmill:router_prefix_hit_blocks_total" in metrics
    for i in (0, 1):  # each replica's own metrics, labelled
        assert f'tokenmill:num_requests_running{{model_name="tiny",replica="{i}"}}' in metrics
    families = [line.split()[2] for line in metrics.splitlines() if line.startswith("# TYPE ")]
    assert len(families) == len(set(families))  # each family once, or scrapers refuse the page


def test_front_keeps_the_api_key_and_relays_other_endpoints(front):
    assert _complete(front, [5, 6, 7]).status_code == 200
    refused = httpx.post(front.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 1}, timeout=10)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert httpx.get(front.url + "/v1/models", timeout=10).status_code == 401
    models = httpx.get(front.url + "/v1/models", timeout=10, headers=KEY)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
    assert "x-tokenmill-replica" in models.headers
    ids = httpx.post(front.url + "/tokenize", json={"prompt": "the mill"}, timeout=10, headers=KEY).json()["tokens"]
    assert httpx.post(front.url + "/detokenize", json={"tokens": ids}, timeout=10,
                      headers=KEY).json()["prompt"].endswith("the mill")
    assert "/v1/chat/completions" in httpx.get(front.url + "/openapi.json", timeout=10, headers=KEY).json()["paths"]


def test_client_disconnect_aborts_at_the_replica(front):
    prompt = [(11 * i) % 300 + 3 for i in range(2 * BS)]
    with httpx.stream("POST", front.url + "/v1/completions", timeout=60, headers=KEY,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 400, "ignore_eos": True,
                            "stream": True}) as r:
        replica = int(r.headers["x-tokenmill-replica"])
        before = front.replica_metric("tokenmill:requests_aborted_total", replica)
        next(r.iter_lines())
    _wait(lambda: front.replica_metric("tokenmill:requests_aborted_total", replica) > before, 10,
          "the replica to abort the request")
    _wait(lambda: all(r["in_flight"] == 0 for r in front.health()["replicas"]), 10, "no request in flight")


def test_killed_replica_fails_its_requests_cleanly_and_restarts(front):
    prompt = [(13 * i) % 300 + 3 for i in range(3 * BS)]
    first = _complete(front, prompt + [1])
    victim = int(first.headers["x-tokenmill-replica"])
    survivor = 1 - victim
    old_pid = front.pids()[victim]
    front.seen_pids.add(old_pid)
    results = {}

    def whole():
        results["whole"] = _complete(front, prompt + [3], max_tokens=400, ignore_eos=True)

    with httpx.stream("POST", front.url + "/v1/completions", timeout=60, headers=KEY,
                      json={"model": "tiny", "prompt": prompt + [2], "max_tokens": 400, "ignore_eos": True,
                            "stream": True}) as stream:
        assert int(stream.headers["x-tokenmill-replica"]) == victim
        lines = stream.iter_lines()
        assert next(lines).startswith("data: {")
        # Freeze the replica mid-stream, so that both requests are surely in flight on it when it dies.
        os.kill(old_pid, signal.SIGSTOP)
        try:
            waiter = threading.Thread(target=whole)
            waiter.start()
            _wait(lambda: front.health()["replicas"][victim]["in_flight"] == 2, 10, "two requests on the victim")
        finally:
            os.kill(old_pid, signal.SIGKILL)
        rest = [line for line in lines if line]
    waiter.join(30)
    # Each in-flight request ends with a clean 503 error in its own shape: a JSON body, or an SSE error
    # event and [DONE] after the stream's events so far.
    assert results["whole"].status_code == 503
    assert results["whole"].json()["error"]["code"] == 503
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))
    assert error["error"]["code"] == 503 and f"replica {victim}" in error["error"]["message"]
    assert all("choices" in json.loads(line.removeprefix("data: ")) for line in rest[:-2])
    # The front stays up and serves from the other replica meanwhile.
    assert front.health()["status"] == "ok"
    again = _complete(front, prompt + [4])
    assert again.status_code == 200 and int(again.headers["x-tokenmill-replica"]) == survivor
    assert front.replica_metric("tokenmill:replica_failed_requests_total", victim) == 2
    # The dead replica is restarted: a new process, ready again.
    _wait(lambda: front.pids()[victim] != old_pid, 10, "the replica's death to be noticed")
    health = front.wait_all_ready(60)
    new = health["replicas"][victim]
    assert new["pid"] != old_pid and new["restarts"] == 1
    front.seen_pids.add(new["pid"])
    assert not _alive(old_pid)
    assert front.replica_metric("tokenmill:replica_restarts_total", victim) == 1
    assert front.replica_metric("tokenmill:replica_up", victim) == 1


def test_killed_front_takes_its_replicas_along(tiny_models):
    srv = Front(tiny_models["llama"], "--dtype", "float32", "--data-parallel-size", "2", "--kv-cache-memory", "4MiB")
    try:
        pids = srv.wait_all_ready()["replicas"]
        pids = [r["pid"] for r in pids]
        assert all(_alive(p) for p in pids)
        srv.proc.kill()  # no chance to clean up: the kernel must take the replicas down
        srv.proc.wait()
        _wait(lambda: not any(_alive(p) for p in pids), 15, "the replicas to die with the front")
    finally:
        srv.stop()


def test_a_hung_replica_is_killed_and_restarted(tiny_models):
    """A replica that is alive but answers nothing (here stopped with SIGSTOP) is killed after
    --replica-hang-timeout seconds without an answer to the front's health probes, and restarted; the other
    replica serves meanwhile."""
    srv = Front(tiny_models["llama"], "--dtype", "float32", "--data-parallel-size", "2", "--kv-cache-memory", "4MiB",
                "--replica-hang-timeout", "2")
    pids: list[int] = []
    try:
        pids = srv.pids() if srv.wait_all_ready() else []
        os.kill(pids[0], signal.SIGSTOP)
        _wait(lambda: not _alive(pids[0]), 20, "the stopped replica to be killed")
        _wait(lambda: srv.pids()[0] != pids[0], 10, "the replica's death to be noticed")
        health = srv.wait_all_ready(60)
        assert health["replicas"][0]["pid"] != pids[0] and health["replicas"][0]["restarts"] == 1
        assert health["replicas"][1]["pid"] == pids[1] and health["replicas"][1]["restarts"] == 0
        pids.append(health["replicas"][0]["pid"])
    finally:
        for pid in pids:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        srv.stop()
        _wait(lambda: not any(_alive(p) for p in pids), 15, "the replicas to exit")


def test_replicas_on_a_ray_cluster(tiny_models):
    """--distributed-executor-backend ray: each replica's server runs on a Ray node (here the one local node,
    listening on its address, not 127.0.0.1), routed to and restarted as a local replica is; nothing of them
    or of the Ray instance the front started outlives the front."""
    pytest.importorskip("ray")
    srv = Front(tiny_models["llama"], "--dtype", "float32", "--data-parallel-size", "2", "--kv-cache-memory", "4MiB",
                "--served-model-name", "tiny", "--distributed-executor-backend", "ray", ready_timeout=180)
    seen: set[int] = set()
    try:
        health = srv.wait_all_ready(120)
        seen.update(r["pid"] for r in health["replicas"])
        assert all(r["host"] != "127.0.0.1" for r in health["replicas"]), health
        answers = [httpx.post(srv.url + "/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": p, "max_tokens": 4, "temperature": 0})
                   for p in ("The quick brown fox", "def add(a, b):")]
        assert all(a.status_code == 200 for a in answers)
        victim = health["replicas"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        _wait(lambda: srv.pids()[0] != victim, 20, "the replica's death to be noticed")
        again = srv.wait_all_ready(120)
        assert again["replicas"][0]["restarts"] == 1
        seen.add(again["replicas"][0]["pid"])
    finally:
        front_pid = srv.proc.pid
        assert srv.stop(timeout=60) == 0
    _wait(lambda: not any(_alive(p) for p in seen), 20, "the replicas to exit")

    def ray_of_front():  # the Ray instance's processes name the driver's pid in their session
        return [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, f"_{front_pid}/")]

    _wait(lambda: not ray_of_front(), 20, "the front's Ray instance to exit")


def _cmdline_has(pid: str, text: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return text.encode() in f.read()
    except OSError:
        return False
