"""The KV cache's block pool and the manager that hands blocks to requests.

Blocks are reference-counted. A full block carries a chained hash of its tokens (and of every token
before it), so a later request with the same prefix can reuse it. Freed blocks keep their hash and
stay findable until the pool needs them again, least recently used first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from tokenmill.engine.request import Request


@dataclass(slots=True, frozen=True)
class BlockHash:
    """Identity of a full block: a digest over its whole prefix, plus its own tokens to confirm hits."""

    digest: bytes
    token_ids: tuple[int, ...]


def hash_block(parent: BlockHash | None, token_ids: list[int] | tuple[int, ...], extra: bytes = b"") -> BlockHash:
    """Chain a block's tokens (and extra keys such as a cache salt) onto its parent's digest."""
    h = hashlib.sha256(parent.digest if parent is not None else b"root")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(extra)
    return BlockHash(h.digest(), tuple(token_ids))


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """A fixed set of blocks: a free queue in LRU order and a map from hash to cached block."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks (ref_cnt == 0), oldest first; insertion order is eviction order.
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> Block | None:
        block = self.cached.get(block_hash.digest)
        # Confirm by token ids: a digest collision must never serve another prompt's KV.
        if block is None or block.block_hash != block_hash:
            return None
        return block

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks (removing them from the free queue if idle)."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free)} free")
        out = []
        for _ in range(n):
            _, b = self.free.popitem(last=False)
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, b: Block) -> None:
        if b.block_hash is not None:
            if self.cached.get(b.block_hash.digest) is b:
                del self.cached[b.block_hash.digest]
            b.block_hash = None

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference from each block; idle ones join the free queue's tail in the given order."""
        for b in blocks:
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"block {b.block_id} released more often than taken"
            if b.ref_cnt == 0:
                if not self.enable_caching:
                    self._evict(b)
                self.free[b.block_id] = b

    def forget(self, b: Block) -> None:
        """Make a block unfindable (its data is not what its hash promises); holders keep it."""
        self._evict(b)

    def cache(self, b: Block, block_hash: BlockHash) -> None:
        if not self.enable_caching or b.block_hash is not None:
            return
        b.block_hash = block_hash
        self.cached.setdefault(block_hash.digest, b)

    def reset_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their data but are no longer findable)."""
        for b in self.blocks:
            b.block_hash = None
        self.cached.clear()


class KVCacheManager:
    """Owns the block pool; gives each request its block table and finds cached prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 recompute_length: int | None = None) -> None:
        self.block_size = block_size
        # The model's kv_recompute_length: the keys and values of sequences longer than this differ from those
        # of shorter ones with the same tokens, so the two kinds share no cached blocks.
        self.recompute_length = recompute_length
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self._pending: dict[int, BlockHash] = {}  # block id -> hash, registered for a step not yet finished
        self.num_queried_tokens = 0  # prefix cache statistics, in tokens
        self.num_hit_tokens = 0

    def _extend_hashes(self, req: Request) -> None:
        """Hash every full block of the request's tokens not hashed yet."""
        bs = self.block_size
        salt = (req.sampling_params.cache_salt or "").encode()
        if self.recompute_length is not None:  # a leading byte, so that no cache salt can imitate another kind
            salt = (b"L" if req.num_tokens > self.recompute_length else b"S") + salt
        while (len(req.block_hashes) + 1) * bs <= req.num_tokens:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            req.block_hashes.append(hash_block(parent, req.token_ids(i * bs, (i + 1) * bs), salt if i == 0 else b""))

    def get_computed_blocks(self, req: Request) -> list[Block]:
        """Cached blocks holding a prefix of the request; never the block of its last token."""
        # A request that wants prompt logprobs needs logits at every prompt position: no hits.
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return []
        self._extend_hashes(req)
        # The last token must be computed so that its logits exist.
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        for h in req.block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        self.num_queried_tokens += req.num_tokens
        self.num_hit_tokens += len(hits) * self.block_size
        return hits

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[Block] | None = None,
                       register: bool = True) -> bool:
        """Give the request blocks for num_new_tokens more tokens; False (and no change) if too few are free.
        register=False: blocks alone, none registered in the prefix cache (for slots written outside a step,
        whose registration the step's own allocation makes)."""
        computed = computed or []
        num_computed = req.num_computed_tokens + len(computed) * self.block_size
        need_total = -(-(num_computed + num_new_tokens) // self.block_size)
        have = len(req.block_ids) + len(computed)
        num_new_blocks = max(0, need_total - have)
        # Hits taken from the free queue shrink what is left to allocate from.
        num_idle_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free - num_idle_hits:
            return False
        if computed:
            self.pool.touch(computed)
            req.block_ids.extend(b.block_id for b in computed)
            req.num_computed_tokens = num_computed
        req.block_ids.extend(b.block_id for b in self.pool.allocate(num_new_blocks))
        # Blocks this step fills are findable at once, so that requests in the same step (n > 1, equal
        # prompts) share them: the forward pass writes every token's KV before attention reads any. Until
        # the step is confirmed they are only pending.
        if register:
            self._cache_full_blocks(req, num_computed + num_new_tokens)
        return True

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Register the blocks that the first num_tokens tokens fill; those past the tokens already
        computed stay pending until confirmed."""
        if not self.enable_caching:
            return
        self._extend_hashes(req)
        full = min(num_tokens // self.block_size, len(req.block_hashes))
        computed = req.num_computed_tokens // self.block_size
        for i in range(req.num_cached_blocks, full):
            block = self.pool.blocks[req.block_ids[i]]
            if block.block_hash is None and i >= computed:
                self._pending[block.block_id] = req.block_hashes[i]
            self.pool.cache(block, req.block_hashes[i])
        req.num_cached_blocks = max(req.num_cached_blocks, full)

    def cache_computed_blocks(self, req: Request, computed_before: int = 0) -> None:
        """After a finished forward pass that took the request from computed_before computed tokens to
        num_computed_tokens: the blocks it filled are written, so confirmed; and those that a burst of decode
        steps filled (they had no tokens yet at allocation) are registered. Blocks full before the pass were
        confirmed by an earlier one, so a decode step costs the same at any context."""
        bs = self.block_size
        full = req.num_computed_tokens // bs
        if self._pending:
            for i in range(min(computed_before // bs, full), full):
                self._pending.pop(req.block_ids[i], None)
        if full > req.num_cached_blocks:
            self._cache_full_blocks(req, req.num_computed_tokens)

    def drop_unwritten(self) -> None:
        """Forget blocks registered for a step that never finished (it raised, or was interrupted): a
        later prompt with the same prefix must compute them, not read KV that was never written."""
        for block_id, block_hash in self._pending.items():
            block = self.pool.blocks[block_id]
            if block.block_hash == block_hash:
                self.pool.forget(block)
        self._pending.clear()

    def free(self, req: Request) -> None:
        """Release a finished, aborted or preempted request's blocks, tail first so prefixes outlive tails."""
        self.pool.release([self.pool.blocks[i] for i in reversed(req.block_ids)])
        req.block_ids = []
        req.num_cached_blocks = 0

    def trim(self, req: Request, num_tokens: int) -> None:
        """Release the request's blocks past those its first num_tokens tokens occupy (tail first). They
        hold no token the request keeps, so none of them is in the prefix cache."""
        keep = -(-num_tokens // self.block_size)
        tail = req.block_ids[keep:]
        if not tail:
            return
        for i in tail:
            self._pending.pop(i, None)
            if self.pool.blocks[i].block_hash is not None:
                self.pool.forget(self.pool.blocks[i])
        self.pool.release([self.pool.blocks[i] for i in reversed(tail)])
        del req.block_ids[keep:]
        req.num_cached_blocks = min(req.num_cached_blocks, keep)

    def usage(self) -> float:
        return self.pool.usage()

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()
