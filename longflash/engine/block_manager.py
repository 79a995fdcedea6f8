"""Paged KV block allocation with prefix caching (vLLM's KV cache manager, nano-vllm's BlockManager).

A logical block covers ``tokens_per_block`` consecutive positions of one sequence. Today that is
``block_size``; under decode-context parallelism it becomes ``block_size * dcp_size`` (each DCP rank
keeps its share of the block in its own physical block with the same id), so nothing here changes.

Prefix caching: every full, computed block gets a chained hash ``h_i = hash((h_{i-1}, tokens_i))``
and is entered in a hash table. A new sequence reuses the longest run of leading blocks whose hash
matches *and* whose stored tokens are equal (hash collisions cannot alias KV). Blocks with
reference count 0 sit in an LRU free queue and keep their hash until they are reused for new data.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from longflash.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    """Allocates physical block ids to sequences.

    Args:
        num_blocks: physical blocks in the pool.
        tokens_per_block: positions per logical block (block_size × dcp_size).
        enable_prefix_caching: reuse full blocks across sequences by content.
    """

    def __init__(self, num_blocks: int, tokens_per_block: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks (ref_count 0), least recently freed first: reused from the front.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # Number of leading blocks of each sequence that are hashed (registered).
        self._num_hashed: dict[str, int] = {}
        self._seq_hashes: dict[str, list[int]] = {}
        # Counters in tokens (vLLM's prefix_cache_queries / hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of blocks in use by live sequences (0..1)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    # ---- prefix cache --------------------------------------------------------------------
    @staticmethod
    def _chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq``, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching:
            return []
        bs = self.tokens_per_block
        max_blocks = (len(seq.token_ids) - 1) // bs
        parent, hits = None, []
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = self._chain_hash(parent, tokens)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != tokens:
                break
            hits.append(bid)
            parent = h
        return hits

    # ---- allocation ----------------------------------------------------------------------
    def _take_free_block(self) -> Block:
        if not self.free_queue:
            raise NoFreeBlocksError("no free KV blocks")
        bid, _ = self.free_queue.popitem(last=False)
        block = self.blocks[bid]
        if block.block_hash is not None:
            # Evict its cached content: it is about to hold new data.
            if self.hash_to_block.get(block.block_hash) == bid:
                del self.hash_to_block[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block

    def _ref(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self.free_queue[bid]
        block.ref_count += 1

    def allocate_for_new(self, seq: Sequence, num_new_tokens: int) -> bool:
        """First scheduling of a waiting sequence: attach cached prefix blocks and allocate blocks
        for ``num_new_tokens`` beyond it. Sets ``seq.num_computed_tokens`` to the cached length.

        Returns False (and changes nothing) if the pool cannot hold them.
        ``num_new_tokens`` is clipped to what remains after the cached prefix.
        """
        assert not seq.block_table, "sequence already has blocks"
        hits = self._match_prefix(seq)
        num_cached = len(hits) * self.tokens_per_block
        num_new_tokens = min(num_new_tokens, len(seq.token_ids) - num_cached)
        need = self.blocks_needed(num_cached + num_new_tokens) - len(hits)
        free_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if need + free_hits > self.num_free_blocks:
            return False
        self.prefix_cache_queries += len(seq.token_ids)
        self.prefix_cache_hits += num_cached
        for bid in hits:
            self._ref(bid)
        seq.block_table = list(hits)
        for _ in range(need):
            seq.block_table.append(self._take_free_block().block_id)
        seq.num_computed_tokens = num_cached
        seq.num_cached_tokens = num_cached
        self._num_hashed[seq.request_id] = len(hits)
        parent = None
        hashes = []
        bs = self.tokens_per_block
        for i in range(len(hits)):
            parent = self._chain_hash(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            hashes.append(parent)
        self._seq_hashes[seq.request_id] = hashes
        return True

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make ``seq.block_table`` cover ``num_computed_tokens + num_new_tokens`` positions.

        Raises NoFreeBlocksError if the pool is exhausted (call ``can_append`` first).
        """
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {need} blocks, {self.num_free_blocks} free")
        for _ in range(max(need, 0)):
            seq.block_table.append(self._take_free_block().block_id)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that are full and computed in the prefix cache. A block is
        hashed only once all its token ids are known: committed speculative tokens whose ids are not
        yet appended to ``seq.token_ids`` wait for a later call."""
        if not self.enable_prefix_caching:
            return
        bs = self.tokens_per_block
        num_full = min(min(seq.num_computed_tokens, len(seq.token_ids)) // bs, len(seq.block_table))
        done = self._num_hashed.get(seq.request_id, 0)
        hashes = self._seq_hashes.setdefault(seq.request_id, [])
        for i in range(done, num_full):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            parent = hashes[i - 1] if i > 0 else None
            h = self._chain_hash(parent, tokens)
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                block.block_hash = h
                block.token_ids = tokens
                self.hash_to_block.setdefault(h, block.block_id)
        self._num_hashed[seq.request_id] = max(done, num_full)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep KV for the first ``num_tokens`` positions only (speculative rollback): blocks past
        them are freed; hashed blocks are never affected because they are full and committed."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def _release(self, bid: int) -> None:
        block = self.blocks[bid]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {bid} freed twice"
        if block.ref_count == 0:
            self.free_queue[bid] = None

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks. Safe to call twice (the second call does nothing)."""
        # Free the tail first so that, under LRU eviction, the tail is evicted before the head
        # (the head is more likely to be shared by later requests).
        for bid in reversed(seq.block_table):
            self._release(bid)
        seq.block_table = []
        self._num_hashed.pop(seq.request_id, None)
        self._seq_hashes.pop(seq.request_id, None)
