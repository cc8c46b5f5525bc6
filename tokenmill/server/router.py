"""Which data-parallel replica serves a request: the one most likely to hold its prompt's prefix in its
KV cache, else the least loaded.

The front cannot see the replicas' caches, so it keeps, per replica, the block hashes of the prompts it has
sent there (the same chained hashes the prefix cache computes, kv_cache.hash_block), bounded and evicted
least recently used first as the replica's own pool is. A request's score on a replica is the number of its
leading blocks found there; the highest score wins, ties go to the replica with the fewest requests in
flight. This is an estimate: a replica may have evicted blocks sooner (other requests' outputs fill its pool
too), which costs a recomputation, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict

from tokenmill.engine.kv_cache import hash_block

ROUTERS = ("prefix", "round_robin")


def prefix_block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """The digests of the prompt's full blocks, chained as the KV cache manager chains them."""
    digests, parent = [], None
    extra = (cache_salt or "").encode()
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra if i == 0 else b"")
        digests.append(parent.digest)
    return digests


class PrefixRouter:
    """Longest cached prefix first, fewest requests in flight as the tie-break (then fewest blocks held).

    balance_threshold: when the replica with the longest prefix has this many more requests in flight than
    the least loaded one, the request goes to the least loaded instead (a hot prefix must not pile every
    request onto one replica while the other idles); None: never.
    """

    name = "prefix"

    def __init__(self, num_replicas: int, capacity_blocks: int = 4096, balance_threshold: int | None = 16) -> None:
        self.capacity = [capacity_blocks] * num_replicas
        self.balance_threshold = balance_threshold
        self.tables: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]

    def score(self, replica: int, hashes: list[bytes]) -> int:
        """Leading blocks of the prompt that the replica is believed to hold."""
        table, n = self.tables[replica], 0
        for h in hashes:
            if h not in table:
                break
            n += 1
        return n

    def choose(self, hashes: list[bytes], loads: list[int], available: list[bool]) -> int:
        """The replica for a prompt with these block hashes; loads: requests in flight per replica."""
        candidates = [i for i, ok in enumerate(available) if ok]
        if not candidates:
            raise LookupError("no replica is available")
        # On equal prefix and load, the replica holding fewer blocks: new prefixes spread over the replicas.
        best = max(candidates, key=lambda i: (self.score(i, hashes), -loads[i], -len(self.tables[i]), -i))
        least = min(candidates, key=lambda i: (loads[i], i))
        if self.balance_threshold is not None and loads[best] - loads[least] >= self.balance_threshold:
            return least
        return best

    def record(self, replica: int, hashes: list[bytes]) -> None:
        """The prompt went to this replica: its blocks are (about to be) cached there, most recent last."""
        table = self.tables[replica]
        for h in hashes:
            table[h] = None
            table.move_to_end(h)
        while len(table) > self.capacity[replica]:
            table.popitem(last=False)

    def forget(self, replica: int) -> None:
        """The replica restarted or dropped its cache: it holds nothing."""
        self.tables[replica].clear()

    def set_capacity(self, replica: int, blocks: int) -> None:
        self.capacity[replica] = max(1, blocks)
        while len(self.tables[replica]) > self.capacity[replica]:
            self.tables[replica].popitem(last=False)


class RoundRobinRouter:
    """Each available replica in turn, whatever the prompt (the baseline the prefix router is measured against)."""

    name = "round_robin"

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self.next = 0

    def score(self, replica: int, hashes: list[bytes]) -> int:
        return 0

    def choose(self, hashes: list[bytes], loads: list[int], available: list[bool]) -> int:
        for k in range(self.num_replicas):
            i = (self.next + k) % self.num_replicas
            if available[i]:
                self.next = i + 1
                return i
        raise LookupError("no replica is available")

    def record(self, replica: int, hashes: list[bytes]) -> None:
        pass

    def forget(self, replica: int) -> None:
        pass

    def set_capacity(self, replica: int, blocks: int) -> None:
        pass


def make_router(kind: str, num_replicas: int):
    if kind == "prefix":
        return PrefixRouter(num_replicas)
    if kind == "round_robin":
        return RoundRobinRouter(num_replicas)
    raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {kind!r}")
