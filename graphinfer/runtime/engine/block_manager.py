"""Paged KV-cache block manager with prefix caching.

A full block whose KV is computed gets a chained hash (parent hash + its tokens), so a block's identity
covers the whole prefix before it. Freed blocks keep their hash and sit in an LRU free list: a later
request with the same prefix revives them; allocation evicts the least recently freed first. Without prefix
caching, allocation takes the most recently freed blocks first instead: their KV pages are warm in the CPU's
caches and already mapped, where a block never used before is page-faulted in by its first write.
Hits are confirmed by comparing tokens, so a hash collision can never serve wrong KV.
"""
from collections import OrderedDict

from graphinfer.runtime.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, use_eagle: bool = False):
        """use_eagle (vLLM's name): a drafter's cache rows (MTP) live in these blocks too, and the row of a block's
        last position was computed with the token after it, which the block's hash does not cover: a prefix hit
        leaves its last block to recompute, so that row is rewritten with this sequence's next token."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.use_eagle = use_eagle
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU order
        self.hash_to_block_id: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Block ids holding a prefix of seq's tokens. The block with the last token never counts,
        so at least one token is always left to compute (its logits are what we sample from)."""
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], seq.cache_key
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash((parent, tokens))
            block_id = self.hash_to_block_id.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits[:-1] if self.use_eagle else hits

    def can_allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        """Room for a fresh sequence's cached prefix plus its first num_new_tokens?"""
        new = self.blocks_needed(len(cached) * self.block_size + num_new_tokens) - len(cached)
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)  # hits still in the free list
        return new + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> None:
        assert not seq.block_table
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self.block_size
        self.append_slots(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table to hold its computed tokens plus num_new_tokens."""
        for _ in range(self._new_blocks(seq, num_new_tokens)):
            block_id, _ = self.free_block_ids.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]  # evict the stale cached prefix
            block.hash, block.token_ids, block.ref_count = None, (), 1
            seq.block_table.append(block_id)

    def _new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def cache_full_blocks(self, seq: Sequence, num_tokens: int | None = None) -> list[int]:
        """Hash the blocks full of seq's first num_tokens tokens (default: its computed ones; never past the tokens
        known on the host), so other requests can reuse them. Returns the block ids it offered to the cache.
        The scheduler calls it with what a step is about to compute (as vLLM v1): a sequence admitted later in the
        same step may then share those blocks, as every layer writes the step's KV before its attention reads any."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        upto = min(seq.num_computed_tokens if num_tokens is None else num_tokens, len(seq.token_ids)) // bs
        offered = []
        for i in range(len(seq.block_hashes), upto):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash((seq.block_hashes[-1] if seq.block_hashes else seq.cache_key, tokens))
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.hash_to_block_id:  # else another sequence already caches this prefix
                block.hash, block.token_ids = h, tokens
                self.hash_to_block_id[h] = block.block_id
                offered.append(block.block_id)
        return offered

    def uncache(self, block_ids: list[int]) -> None:
        """Withdraw blocks from the prefix cache: the step that was to write their KV failed (its sequences are
        aborted), so no later request may hit them."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = None, ()

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past seq's computed tokens (speculative decoding: lookahead blocks that held only
        rejected drafts). They hold no hash, so they go first in the LRU."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        for block_id in seq.block_table[keep:]:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                self.free_block_ids.move_to_end(block_id, last=False)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks; tail blocks go first in the LRU so shared prefixes outlive them. Without prefix
        caching they go to the front, in table order: the next allocation reuses them (LIFO)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if not self.enable_prefix_caching:
                    self.free_block_ids.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
