"""Block-level prefix caching: vLLM's automatic prefix caching on the state machine's blocks.

What it follows (vllm/v1/core/kv_cache_manager.py, block_pool.py, kv_cache_utils.py; read at
vllm-project/vllm commits 003df296 and 002f3491):

- A block of ``block_size`` tokens is identified by the hash of its contents chained on the
  previous block's hash (``hash_block_tokens(parent_hash, block_tokens)``), so equal hashes
  mean equal prefixes. Only full blocks are cached.
- A block is cached once it is full of computed tokens, with its request as its owner;
  blocks hold a reference count (requests using them).
- A hit (``get_computed_blocks``) is the longest run of leading cached blocks, at most
  ``num_tokens - 1`` tokens: the last token is always computed, for its logits. The hit
  blocks are *touched* (reference count + 1; a block with no reference leaves the free pool).
- A finished or preempted request frees its blocks, tail first (``free`` reverses them, so
  the tail is evicted first); a cached block with no reference stays cached but free,
  an eviction candidate, least recently freed first (the free queue's order).
- Allocating a block when no empty block is left evicts the least recently freed cached
  block (``_maybe_evict_cached_block``).

Where it differs, and why:

- vLLM registers a block's hash when the block is *allocated* for the tokens a step will
  compute (``cache_blocks`` in ``allocate_slots``), so a request scheduled later in the same
  step hits blocks that step computes. Here a block is cached when the pass that computes it
  has run: a request admitted in the same step as the first computation of a prefix misses it
  (our engine could not read KV another forward of the same pass is writing).
- vLLM keeps every free block in one queue and evicts its head, which may be a cached block
  while a never-cached free block sits behind it; here empty blocks are used first and a
  cached block is evicted only when none is left (same order among the cached ones).
- A block computed while an identical one is already cached (two requests prefilling the
  same new prefix at once) stays private, as in vLLM; vLLM also files it under the hash (a
  second copy to hit), this cache keeps the first one only.

Block contents. The simulator has no token ids; a block's contents are what the engine
(``engine.sampling.prompt_ids``) will put there: within a prompt's ``prefix_ids`` (Mooncake's
``hash_ids``, one per 512 tokens) token p is token ``p % 512`` of shared block
``prefix_ids[p // 512]``; every other token (the rest of the prompt, and generated tokens)
belongs to its request alone. ``token_keys`` replaces this with real token ids (text prompts
tokenized by the caller): ``token_keys(request) -> list of ids`` for the prompt.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Callable, Sequence

#: Tokens per ``prefix_ids`` block (Mooncake's hash block; engine.sampling.BLOCK).
SHARED_BLOCK = 512


def _h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class Blocks:
    """One request's blocks in the prefix cache."""

    __slots__ = ("cache", "hashes", "refs", "registered", "key", "ids")

    def __init__(self, cache: "PrefixCache", rid: str):
        self.cache = cache
        self.hashes: list[int] = []  # chain hashes of its blocks, made on demand
        self.refs: list[int] = []  # cached blocks it references (hits and blocks it registered)
        self.registered = 0  # leading blocks already processed (hit, registered or duplicate)
        self.key = _h64(rid)  # contents of the tokens that are its own
        self.ids: Sequence[int] | None = None  # prompt token ids (token_keys)


class PrefixCache:
    """The cached blocks of one replica: reference counts, owners, LRU of free cached blocks.

    The state machine owns the block counts (``ReplicaState.blocks_used``); this class says
    how many blocks a hit takes from the free pool, how many a release returns, and evicts.
    """

    def __init__(self, block_size: int, token_keys: Callable[[Any], Sequence[int] | None] | None = None):
        self.bs = int(block_size)
        self.token_keys = token_keys
        self.ref: dict[int, int] = {}  # every cached block: hash -> references (0: free)
        self.owner: dict[int, tuple[str, int]] = {}  # hash -> (request id, block index) that computed it
        self.free: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: least recently freed first
        self.owned: dict[str, int] = {}  # request id -> cached blocks it owns
        self.on_owner_gone: Callable[[str], None] | None = None  # a request owns no cached block any more
        # statistics, in tokens (vLLM's PrefixCacheStats: queries and hits per lookup)
        self.queries = self.hits = 0  # every admission (first ones and resumptions)
        self.first_queries = self.first_hits = 0  # first admissions: prompt tokens and their hits
        self.evictions = 0

    # ------------------------------------------------------------------ hashes
    def chain(self, r, n_blocks: int) -> list[int]:
        """The chain hashes of ``r``'s first ``n_blocks`` blocks (made once, extended on demand)."""
        b = r._blk
        hs = b.hashes
        if len(hs) >= n_blocks:
            return hs
        bs = self.bs
        own = b.key
        h = hs[-1] if hs else 0
        if self.token_keys is not None and b.ids is None:
            b.ids = self.token_keys(r) or ()
        ids = b.ids
        if ids:
            n_ids = len(ids)
            for j in range(len(hs), n_blocks):
                lo = j * bs
                key = tuple(ids[lo : lo + bs]) if lo + bs <= n_ids else own
                h = hash((h, key))
                hs.append(h)
            return hs
        pid = r.prefix_ids or ()
        shared_end = min(r.prompt_tokens, SHARED_BLOCK * len(pid))
        for j in range(len(hs), n_blocks):
            lo = j * bs
            hi = lo + bs
            if hi <= shared_end:
                m0, m1 = lo // SHARED_BLOCK, (hi - 1) // SHARED_BLOCK
                key = (pid[m0], lo % SHARED_BLOCK) if m0 == m1 else (*pid[m0 : m1 + 1], lo % SHARED_BLOCK)
            else:
                key = own
            h = hash((h, key))
            hs.append(h)
        return hs

    # ------------------------------------------------------------------ lookups
    def lookup(self, r) -> tuple[int, int]:
        """(hit blocks, how many of them are free now) if ``r`` were admitted now."""
        limit = (r._target - 1) // self.bs
        if limit <= 0:
            return 0, 0
        ref = self.ref
        k = touched = 0
        for h in self.chain(r, limit):
            if k == limit:
                break
            c = ref.get(h)
            if c is None:
                break
            k += 1
            if c == 0:
                touched += 1
        return k, touched

    def hit_tokens(self, r) -> int:
        return self.lookup(r)[0] * self.bs

    # ------------------------------------------------------------------ changes
    def admit(self, r, k: int, first: bool) -> int:
        """``r`` is admitted with a hit of ``k`` blocks: touch them. Returns the blocks that
        left the free pool (they were cached and unreferenced)."""
        b = r._blk
        self.queries += r._target
        self.hits += k * self.bs
        if first:
            self.first_queries += r.prompt_tokens
            self.first_hits += k * self.bs
        taken = 0
        ref, free = self.ref, self.free
        hs = b.hashes[:k]
        for h in hs:
            c = ref[h]
            if c == 0:
                del free[h]
                taken += 1
            ref[h] = c + 1
        b.refs = hs
        b.registered = k
        return taken

    def register(self, r, full: int) -> None:
        """``r`` now has ``full`` full blocks of computed tokens: cache the new ones."""
        b = r._blk
        j0 = b.registered
        if full <= j0:
            return
        ref, owner = self.ref, self.owner
        rid = r.id
        mine = 0
        for j, h in enumerate(self.chain(r, full)[j0:full], j0):
            if h in ref:
                continue  # computed while an identical block was cached: it stays private
            ref[h] = 1
            owner[h] = (rid, j)
            b.refs.append(h)
            mine += 1
        if mine:
            self.owned[rid] = self.owned.get(rid, 0) + mine
        b.registered = full

    def release(self, r, n_blocks: int) -> int:
        """``r`` (holding ``n_blocks`` blocks) frees them, tail first. Returns how many blocks
        return to the free pool: its private blocks and cached ones nobody references now."""
        b = r._blk
        ref, free = self.ref, self.free
        back = n_blocks - len(b.refs)
        for h in reversed(b.refs):
            c = ref[h] - 1
            ref[h] = c
            if c == 0:
                free[h] = None
                back += 1
        b.refs = []
        b.registered = 0
        return back

    def freeable(self, r, n_blocks: int) -> int:
        """Blocks that would return to the free pool if ``r`` released its ``n_blocks`` now."""
        ref = self.ref
        return n_blocks - len(r._blk.refs) + sum(1 for h in r._blk.refs if ref[h] == 1)

    def evict(self, n: int) -> None:
        """Evict the ``n`` least recently freed cached blocks (their slots are needed)."""
        free, ref, owner, owned = self.free, self.ref, self.owner, self.owned
        for _ in range(n):
            h, _ = free.popitem(last=False)
            del ref[h]
            rid, _ = owner.pop(h)
            left = owned[rid] - 1
            if left:
                owned[rid] = left
            else:
                del owned[rid]
                if self.on_owner_gone is not None:
                    self.on_owner_gone(rid)
        self.evictions += n

    def stats(self) -> dict[str, Any]:
        return {
            "block_size": self.bs,
            "hit_rate": self.first_hits / self.first_queries if self.first_queries else None,
            "prompt_tokens_queried": self.first_queries,
            "prompt_tokens_hit": self.first_hits,
            "saved_prefill_tokens": self.hits,
            "lookups_hit_rate": self.hits / self.queries if self.queries else None,
            "evicted_blocks": self.evictions,
            "cached_blocks_at_end": len(self.ref),
        }
