import pytest

from pagedllm.core.block_pool import BlockPool, extend_block_hashes, hash_block_tokens


def test_new_blocks_come_from_the_head_in_id_order():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    assert pool.free_queue.block_ids() == [3]


def test_freed_blocks_go_to_the_tail_in_the_given_order():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert pool.free_queue.block_ids() == [3, 2, 1, 0]
    assert all(b.ref_cnt == 0 for b in blocks)


def test_shared_block_is_free_only_after_its_last_reference():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 2


def test_double_free_is_an_invariant_violation():
    pool = BlockPool(1)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


def test_free_queue_removes_from_the_middle_in_constant_time():
    pool = BlockPool(5)
    middle = pool.blocks[2]
    pool.touch([middle])  # a cache hit on a free block takes it out of the queue
    assert pool.free_queue.block_ids() == [0, 1, 3, 4]
    assert pool.num_free_blocks == 4


def test_cached_block_survives_free_until_evicted_by_a_new_allocation():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"h" * 32, (1, 2))
    pool.free_blocks([a, b])
    assert pool.get_cached_block(b"h" * 32, (1, 2)) is a
    (first,) = pool.get_new_blocks(1)  # a is at the head: least recently freed goes first
    assert first is a
    assert pool.get_cached_block(b"h" * 32, (1, 2)) is None
    assert pool.num_evictions == 1


def test_cache_hit_compares_tokens_not_only_the_hash():
    pool = BlockPool(1)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, b"h" * 32, (1, 2))
    assert pool.get_cached_block(b"h" * 32, (1, 3)) is None


def test_pool_refuses_zero_blocks():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def test_hash_chain_is_a_prefix_hash():
    a, b = [], []
    extend_block_hashes(a, [1, 2, 3, 4, 5, 6, 7], 2)
    extend_block_hashes(b, [1, 2, 3, 9, 5, 6], 2)
    assert len(a) == 3 and len(b) == 3
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]  # one differing token changes its block and every later one


def test_hash_depends_on_parent_tokens_and_extra_keys():
    base = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2]) == base  # stable
    assert len(base) == 32
    assert hash_block_tokens(base, [1, 2]) != base
    assert hash_block_tokens(None, [1, 2], ("salt",)) != base
    assert hash_block_tokens(None, [1, 2], ("a",)) != hash_block_tokens(None, [1, 2], ("b",))
