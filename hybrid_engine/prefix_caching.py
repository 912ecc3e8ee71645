"""Prefix caching, the engine's half: which prefix a new request starts from, where GDN
checkpoints are taken, and the counters (the memory itself is state_cache's).

A request can resume only at a length L where an earlier request left a checkpoint, so where
checkpoints are taken decides the hit rate (docs: ARCHITECTURE.md section 9). They are taken
- at the end of each prefill, at its last block boundary, where a longer prompt that starts
  with this one resumes, and at the last block boundary before its last token, where an exact
  repeat resumes (a hit must leave one token to compute for its logits; the two differ only
  for a block-aligned prompt);
- at branch points: the block-aligned common prefix of a prefilling request with any other
  queued or running request, or with the cached blocks (a shared system prompt followed by
  different user messages: the second such request, arriving alone, finds the first one's
  blocks cached without a checkpoint where they part, and leaves one there for the third);
- every `checkpoint_interval` tokens of a prefill, when configured;
- while decoding, at each block boundary the committed length crosses, into the request's
  own pending checkpoint, published when it finishes or is preempted (so the next chat turn,
  or its own readmission, hits).

A checkpoint inside a prefill chunk is captured by the chunk's own forward, with no extra
step (`plan_captures`): the chunked GDN kernel puts a chunk boundary at each wanted position
and writes the state there into a reserved checkpoint entry, the layer writes the conv window
(the K-1 inputs before it), and `take_checkpoints` adds the hidden state at the position
before it from the same forward. While decoding, the state after each accepted position is
already in the verify's write slots; a position past the accepted ones never becomes a
checkpoint.

A waiting request that shares more of its prefix with a running request's unfinished prefill
than the cache can give it now waits for that prefill to pass the branch point (one or a few
steps), rather than computing the shared part a second time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_engine.state_cache import HybridCacheManager, PrefixHit, chain_hashes

from .request import Request


@dataclass
class PrefixStats:
    num_queries: int = 0          # admissions that looked the prompt up
    num_query_tokens: int = 0     # tokens those admissions had to compute without the cache
    num_hits: int = 0
    num_hit_tokens: int = 0       # tokens served from the cache
    num_checkpoints_taken: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def as_dict(self) -> dict:
        return {"queries": self.num_queries, "query_tokens": self.num_query_tokens, "hits": self.num_hits,
                "hit_tokens": self.num_hit_tokens, "hit_rate": self.hit_rate,
                "checkpoints_taken": self.num_checkpoints_taken}


class PrefixCaching:
    def __init__(self, cache: HybridCacheManager, block_size: int, checkpoint_interval: int | None = None):
        self.cache = cache
        self.store = cache.prefix_store
        self.block_size = block_size
        self.checkpoint_interval = checkpoint_interval
        self.stats = PrefixStats()

    # -- hashes ---------------------------------------------------------------------------

    def block_hashes(self, req: Request) -> list[bytes]:
        """The chain hash of each full block of the request's tokens (kept on the request,
        extended as it grows)."""
        bs, hashes = self.block_size, req.block_hashes
        full = req.num_tokens // bs
        if len(hashes) < full:
            parent = hashes[-1] if hashes else None
            hashes.extend(chain_hashes(req.token_ids_in(len(hashes) * bs, full * bs), bs, parent))
        return hashes

    def _hash_through(self, req: Request, num_tokens: int, emitted: list[int]) -> bytes:
        """The chain hash of the block ending at num_tokens, where the tokens past the known ones
        are this step's emitted tokens (not appended yet)."""
        bs, hashes = self.block_size, self.block_hashes(req)
        i = num_tokens // bs
        if i <= len(hashes):
            return hashes[i - 1]
        have = len(hashes) * bs
        tokens = req.token_ids_in(have, req.num_tokens) + emitted
        return chain_hashes(tokens[:num_tokens - have], bs, hashes[-1] if hashes else None)[-1]

    @staticmethod
    def _common_blocks(a: list[bytes], b: list[bytes]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n

    def requests_by_first_block(self, requests: list[Request]) -> dict[bytes, list[Request]]:
        """The requests with a full block, by the hash of their first: only requests under one
        key can share a block-aligned prefix (a branch point). Two of each distinct chain of
        full blocks (named by its last hash) stand for all of them: the branch points they give
        are the same, and two so that one remains when the request asking is one of them.
        Built once per schedule, so that finding a prefill's branch points costs its distinct
        peers, not every queued request (with thousands queued, a scan per admission made
        scheduling quadratic)."""
        groups: dict[bytes, list[Request]] = {}
        per_chain: dict[bytes, int] = {}
        for r in requests:
            hashes = self.block_hashes(r)
            if hashes and per_chain.get(hashes[-1], 0) < 2:
                per_chain[hashes[-1]] = per_chain.get(hashes[-1], 0) + 1
                groups.setdefault(hashes[0], []).append(r)
        return groups

    # -- admission --------------------------------------------------------------------------

    def match(self, req: Request) -> PrefixHit | None:
        """The longest cached prefix the request can start from: at least one token left, and
        no prompt position it must still score for prompt_logprobs (Request.max_prefix_hit)."""
        return self.store.match(self.block_hashes(req), req.max_prefix_hit)

    def should_wait(self, req: Request, hit: PrefixHit | None, running: list[Request]) -> bool:
        """True while a running request's prefill is still computing a longer prefix of this
        one than the cache holds; its forward will leave a checkpoint at that branch point."""
        have = hit.num_tokens if hit is not None else 0
        mine = self.block_hashes(req)
        for other in running:
            if other.num_computed_tokens >= len(other.prompt_token_ids):
                continue                                   # decoding: takes no branch checkpoint
            shared = self._common_blocks(mine, self.block_hashes(other)) * self.block_size
            shared = min(shared, req.max_prefix_hit // self.block_size * self.block_size)   # what a hit may serve
            if shared > have and other.num_computed_tokens < shared:
                return True
        return False

    def admitted(self, req: Request, hit: PrefixHit | None) -> None:
        s = self.stats
        s.num_queries += 1
        s.num_query_tokens += req.num_tokens
        hit_tokens = hit.num_tokens if hit is not None else 0
        if hit is not None:
            s.num_hits += 1
            s.num_hit_tokens += hit_tokens
        if not req.output_token_ids:                      # as vLLM: the prompt's cached tokens
            req.num_cached_tokens = hit_tokens

    # -- checkpoints ----------------------------------------------------------------------

    def plan_captures(self, prefills: list[tuple[Request, int]], others: list[Request]
                      ) -> dict[str, list[tuple[int, int]]]:
        """For each prefill chunk (request, tokens from its computed ones): the wanted checkpoint
        positions inside it, each with the checkpoint entry reserved for its forward to write."""
        reserved = []
        peers = self.requests_by_first_block(others) if prefills else {}
        for req, n in prefills:
            start = req.num_computed_tokens
            hashes = self.block_hashes(req)
            mine = peers.get(hashes[0], []) if hashes else []
            for p in self._checkpoint_positions(req, mine, start, start + n):
                entry = self.store.reserve_checkpoint(hashes[p // self.block_size - 1], p)
                if entry is not None:
                    reserved.append((req.request_id, p, entry))
        # A full pool evicts its least recently used entry for the next reservation, which can
        # be one reserved just before: that capture is void (its key is gone), only the last
        # reservation of an entry is written.
        last = {entry: i for i, (_, _, entry) in enumerate(reserved)}
        captures: dict[str, list[tuple[int, int]]] = {}
        for i, (request_id, p, entry) in enumerate(reserved):
            if last[entry] == i:
                captures.setdefault(request_id, []).append((p, entry))
        return captures

    def _checkpoint_positions(self, req: Request, others: list[Request], start: int, end: int) -> list[int]:
        """Block-aligned positions in (start, end] of the request's prefill where a checkpoint is
        wanted and none is held yet, ascending."""
        bs, hashes = self.block_size, self.block_hashes(req)
        last = req.num_tokens // bs * bs
        if last <= start:
            return []
        wanted = {last, (req.num_tokens - 1) // bs * bs}
        if self.checkpoint_interval:
            wanted.update(range(self.checkpoint_interval, last, self.checkpoint_interval))
        cached = self.store.num_cached_blocks(hashes)
        if cached:
            wanted.add(cached * bs)
        for other in others:
            if other is not req:
                shared = self._common_blocks(hashes, self.block_hashes(other))
                if shared:
                    wanted.add(shared * bs)
        return sorted(p for p in wanted if start < p <= end and not self.store.has_checkpoint(hashes[p // bs - 1]))

    def void_captures(self, captures: dict[str, list[tuple[int, int]]]) -> None:
        """Discards the checkpoint entries `plan_captures` reserved for a forward that failed."""
        self.store.discard([entry for caps in captures.values() for _, entry in caps])

    def take_checkpoints(self, results, hidden: torch.Tensor) -> None:
        """After a step's forward, before its update (a verify's slots are still as written): the
        hidden states of the checkpoints its prefill chunks captured, and a pending checkpoint
        for each decode that committed a block boundary. `results`: the step's SegmentResults;
        `hidden`: the target's final-normed hidden states of its rows."""
        bs = self.block_size
        for result in results:
            seg, req = result.segment, result.segment.request
            if not seg.is_decode:
                for p, entry in seg.captures:
                    self.store.write_hidden(entry, hidden[seg.first_row + p - seg.start - 1])
                    self.stats.num_checkpoints_taken += 1
                continue
            # Committed after this verify: start + accepted + 1 = start + emitted tokens.
            end = (seg.start + len(result.token_ids)) // bs * bs
            if end <= seg.start:
                continue
            rc = self.cache.get(req.request_id)
            j = end - seg.start - 1                   # write slot j: the state after position start + j
            slot = rc.write_slot(j)
            key = self._hash_through(req, end, result.token_ids)
            row = hidden[seg.first_row + j] if self.cache.spec.hidden_size else None   # kept for MTP only
            if self.store.save_checkpoint(req.request_id, end, key, slot, row, pending=True):
                self.stats.num_checkpoints_taken += 1

    # -- blocks -----------------------------------------------------------------------------

    def cache_blocks(self, req: Request) -> None:
        """Registers the request's committed full blocks, so that others can share them. Called
        for every request every step: most steps fill no block, and then nothing is hashed."""
        rc = self.cache.get(req.request_id)
        if rc.num_committed_tokens // self.block_size > rc.num_cached_blocks:
            self.store.cache_blocks(req.request_id, self.block_hashes(req))

    def before_free(self, req: Request) -> None:
        self.cache_blocks(req)
