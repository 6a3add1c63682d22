"""BlockManager on its own: the chained prefix hash, the LRU of freed blocks, reference counts and trim."""
from graphinfer.runtime.engine.block_manager import BlockManager
from graphinfer.runtime.engine.sequence import Sequence
from graphinfer.sampling_params import SamplingParams

BS = 4


def seq(tokens, rid="r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), max_tokens=8)


def run_prompt(bm: BlockManager, s: Sequence) -> list[int]:
    """Schedule s's whole prompt as the scheduler does (cached prefix + the rest), 'compute' it, cache its blocks."""
    cached = bm.find_cached_blocks(s)
    assert bm.can_allocate(s, cached, s.num_tokens - len(cached) * BS)
    bm.allocate(s, cached, s.num_tokens - len(cached) * BS)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return cached


def test_hits_follow_the_hash_chain_and_leave_the_last_token():
    bm = BlockManager(16, BS)
    a = seq(list(range(12)), "a")  # 3 full blocks
    assert run_prompt(bm, a) == []
    assert len(a.block_hashes) == 3 and len(bm.hash_to_block_id) == 3
    # the same 12 tokens: only 2 blocks hit, the block holding the last token is computed again (its logits)
    again = seq(list(range(12)), "b")
    assert bm.find_cached_blocks(again) == a.block_table[:2]
    # one more token: all 3 blocks hit
    assert bm.find_cached_blocks(seq(list(range(13)), "c")) == a.block_table[:3]
    # block 1's tokens after a different block 0: a block's identity is its whole prefix, so nothing hits
    assert bm.find_cached_blocks(seq([99, 1, 2, 3] + list(range(4, 13)), "d")) == []
    # diverging inside block 1: only block 0 hits
    assert bm.find_cached_blocks(seq([0, 1, 2, 3, 4, 5, 99, 7, 8, 9, 10, 11, 12], "e")) == a.block_table[:1]


def test_a_hash_collision_never_serves_other_tokens():
    bm = BlockManager(8, BS)
    a = seq(list(range(9)), "a")
    run_prompt(bm, a)
    # forge a collision: the hash of block 0 now points at block 1, which holds other tokens
    bm.hash_to_block_id[a.block_hashes[0]] = a.block_table[1]
    assert bm.find_cached_blocks(seq(list(range(9)), "b")) == []


def test_shared_blocks_are_reference_counted():
    bm = BlockManager(8, BS)
    a, b = seq(list(range(9)), "a"), seq(list(range(9)) + [50], "b")
    run_prompt(bm, a)
    free_after_a = bm.num_free_blocks
    assert run_prompt(bm, b) == a.block_table[:2]
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == free_after_a - 1  # b added only its own third block
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    assert not set(b.block_table) & set(bm.free_block_ids)  # still in use: not free
    bm.free(b)
    assert bm.num_free_blocks == 8 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_freed_blocks_revive_and_count_against_free_space():
    bm = BlockManager(4, BS)
    a = seq(list(range(9)), "a")
    run_prompt(bm, a)
    table = list(a.block_table)
    bm.free(a)  # all 4 free again, but blocks 0 and 1 still hold a's prefix
    b = seq(list(range(8)) + [7] * 7, "b")  # 15 tokens: 4 blocks, 2 of them cached
    cached = bm.find_cached_blocks(b)
    assert cached == table[:2]
    assert bm.can_allocate(b, cached, b.num_tokens - 8)  # 2 revived + 2 new = 4 free
    assert not bm.can_allocate(b, cached, b.num_tokens - 8 + BS)  # one block more does not fit
    bm.allocate(b, cached, b.num_tokens - 8)
    assert bm.num_free_blocks == 0 and b.num_computed_tokens == 8


def test_lru_evicts_the_least_recently_freed_and_tails_first():
    bm = BlockManager(4, BS)
    a = seq(list(range(12)), "a")  # blocks 0, 1, 2; block 3 never used
    run_prompt(bm, a)
    table = list(a.block_table)
    bm.free(a)
    # free order: the unused block first, then a's blocks tail first, so its prefix outlives its tail
    assert list(bm.free_block_ids) == [3, table[2], table[1], table[0]]
    c = seq([100 + i for i in range(5)], "c")  # 2 blocks: the unused one and a's tail (its hash evicted)
    run_prompt(bm, c)
    assert c.block_table == [3, table[2]]
    assert len(bm.hash_to_block_id) == 2 + 1  # a's first two blocks + c's first
    assert bm.find_cached_blocks(seq(list(range(13)), "d")) == table[:2]


def test_trim_returns_lookahead_blocks_first():
    bm = BlockManager(8, BS)
    a = seq(list(range(6)), "a")
    run_prompt(bm, a)  # 2 blocks
    bm.append_slots(a, 7)  # 6 + 7 = 13 tokens: 4 blocks (drafts in the lookahead slots)
    assert len(a.block_table) == 4
    lookahead = a.block_table[2:]
    a.num_computed_tokens = 8  # two drafts accepted: 8 tokens computed, 2 blocks kept
    bm.trim(a)
    assert len(a.block_table) == 2
    assert list(bm.free_block_ids)[:2] == lookahead[::-1]  # no hash: reused before any cached block
    assert all(bm.blocks[i].ref_count == 0 for i in lookahead)


def test_no_prefix_caching_means_no_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = seq(list(range(9)), "a")
    run_prompt(bm, a)
    assert bm.hash_to_block_id == {} and bm.find_cached_blocks(seq(list(range(9)), "b")) == []


def _check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    """Every block is either free (ref 0, in the LRU) or held (ref = the number of live tables that hold it), and
    every cached hash points at a block that carries it."""
    held = {}
    for s in live:
        for b in s.block_table:
            held[b] = held.get(b, 0) + 1
    assert {b.block_id: b.ref_count for b in bm.blocks if b.ref_count} == held
    assert set(bm.free_block_ids) == set(range(bm.num_blocks)) - set(held)
    assert all(bm.blocks[b].hash == h for h, b in bm.hash_to_block_id.items())


def test_a_blocks_hash_chains_its_parents():
    """The same 4 tokens in block 1 hash differently after different blocks 0; the same whole prefix, the same hash."""
    bm = BlockManager(16, BS)
    a, b, c = seq([0, 1, 2, 3, 10, 11, 12, 13, 0], "a"), seq([9, 1, 2, 3, 10, 11, 12, 13, 0], "b"), \
        seq([0, 1, 2, 3, 10, 11, 12, 13, 5], "c")
    for s in (a, b):
        run_prompt(bm, s)
    assert a.block_hashes[0] != b.block_hashes[0] and a.block_hashes[1] != b.block_hashes[1]
    assert a.block_hashes[1] == hash((a.block_hashes[0], (10, 11, 12, 13)))  # (parent hash, own tokens)
    assert b.block_hashes[1] == hash((b.block_hashes[0], (10, 11, 12, 13)))
    assert run_prompt(bm, c) == a.block_table[:2] and c.block_hashes == a.block_hashes  # same prefix: a's blocks
    assert len(bm.hash_to_block_id) == 4  # a's two, b's two; c added none


def test_lru_evicts_the_earliest_freed_sequence_first():
    """Two finished sequences: new blocks come from the one freed first; the later one's prefix still hits."""
    bm = BlockManager(4, BS)
    a, b = seq(list(range(5)), "a"), seq(list(range(50, 55)), "b")  # 5 tokens: 2 blocks each, one full
    run_prompt(bm, a)
    run_prompt(bm, b)
    ta, tb = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    assert list(bm.free_block_ids) == [ta[1], ta[0], tb[1], tb[0]]
    c = seq([200 + i for i in range(5)], "c")  # takes 2 blocks: both of a's (a's cached prefix is evicted)
    run_prompt(bm, c)
    assert sorted(c.block_table) == sorted(ta)
    assert bm.find_cached_blocks(seq(list(range(5)), "a2")) == []
    assert bm.find_cached_blocks(seq(list(range(50, 55)), "b2")) == tb[:1]
    # a revived block leaves the LRU; freed again, it is the most recently freed
    d = seq(list(range(50, 55)), "d")
    run_prompt(bm, d)
    assert d.block_table[0] == tb[0] and tb[0] not in bm.free_block_ids
    bm.free(d)
    assert list(bm.free_block_ids)[-1] == tb[0]


def test_a_shared_prefix_outlives_the_sequence_that_cached_it():
    """a caches a prefix, b shares it; a finishes: b still holds the blocks (not free, not evictable), and a third
    request still hits them while b runs."""
    bm = BlockManager(6, BS)
    a, b = seq(list(range(9)), "a"), seq(list(range(9)) + [77, 78], "b")
    run_prompt(bm, a)
    run_prompt(bm, b)
    shared = a.block_table[:2]
    bm.free(a)
    _check_invariants(bm, [b])
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1] and not set(shared) & set(bm.free_block_ids)
    filler = seq([300 + i for i in range(bm.num_free_blocks * BS)], "f")  # takes every free block
    run_prompt(bm, filler)
    assert bm.num_free_blocks == 0 and not set(shared) & set(filler.block_table)
    assert bm.find_cached_blocks(seq(list(range(9)), "c")) == shared
    bm.free(filler)
    bm.free(b)
    _check_invariants(bm, [])


def test_no_block_leaks_over_many_requests():
    """Requests sharing prefixes, growing by decode steps, trimmed after rejected drafts, freed in mixed order: the
    ref counts always match the live tables, and once all are freed every block is free with ref count 0."""
    import random

    rng = random.Random(0)
    bm = BlockManager(24, BS)
    prefixes = [[rng.randrange(100) for _ in range(rng.choice((4, 6, 8)))] for _ in range(3)]
    live = []
    for step in range(200):
        if live and (rng.random() < 0.35 or not bm.num_free_blocks):
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
            assert s.block_table == [] and s.block_hashes == []
        elif rng.random() < 0.5 and live:  # a decode step, sometimes with drafts trimmed afterwards
            s = rng.choice(live)
            k = rng.choice((1, 1, 3))
            if bm.can_append(s, k):
                bm.append_slots(s, k)
                s.append_token(rng.randrange(100))
                s.num_computed_tokens += 1
                bm.trim(s)
                bm.cache_full_blocks(s)
        else:
            s = seq(rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randrange(1, 7))], f"r{step}")
            cached = bm.find_cached_blocks(s)
            if bm.can_allocate(s, cached, s.num_tokens - len(cached) * BS):
                run_prompt(bm, s)
                live.append(s)
        _check_invariants(bm, live)
    for s in live:
        bm.free(s)
    _check_invariants(bm, [])
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_without_prefix_caching_the_most_recently_freed_blocks_are_reused_first():
    """LIFO: a new sequence gets the blocks the last one freed, in the same order (pages warm and mapped), not the
    least recently freed (with caching on, the LRU keeps cached prefixes alive longest)."""
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = seq(list(range(10)), "a")
    run_prompt(bm, a)
    first = list(a.block_table)
    assert first == [0, 1, 2]
    bm.free(a)
    b = seq(list(range(30, 40)), "b")
    run_prompt(bm, b)
    assert b.block_table == first
    bm.free(b)
    assert bm.num_free_blocks == 16
