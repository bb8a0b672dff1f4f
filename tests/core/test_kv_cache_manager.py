from pagedllm.core.kv_cache_manager import KVCacheManager

from .helpers import make_request


def test_blocks_are_allocated_only_at_block_boundaries():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    req = make_request(5)
    assert kv.allocate_slots(req, 5) == [0, 1]  # 5 tokens -> 2 blocks
    req.num_computed_tokens = 5
    for expected_new, num_computed_after in [([], 6), ([], 7), ([], 8), ([2], 9), ([], 10)]:
        assert kv.allocate_slots(req, 1) == expected_new
        req.num_computed_tokens = num_computed_after
    assert kv.get_block_ids(req.req_id) == [0, 1, 2]


def test_allocation_that_does_not_fit_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=False)
    a, b = make_request(8), make_request(8)
    assert kv.allocate_slots(a, 8) == [0, 1]
    assert kv.allocate_slots(b, 8) is None
    assert kv.get_block_ids(b.req_id) == []
    assert kv.pool.num_free_blocks == 1


def test_free_releases_everything_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    req = make_request(12)
    kv.allocate_slots(req, 12)
    kv.free(req)
    assert kv.pool.free_queue.block_ids() == [3, 2, 1, 0]
    assert kv.check_no_leaks() == []


def test_prefix_cache_hit_reuses_blocks_but_never_the_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    first = make_request(12)
    kv.allocate_slots(first, 12)
    first.num_computed_tokens = 12
    second = make_request(12)  # same tokens
    hits, num_hit_tokens = kv.get_computed_blocks(second)
    # 12 tokens = 3 full blocks, but the last token must be computed: only 2 blocks hit
    assert [b.block_id for b in hits] == [0, 1]
    assert num_hit_tokens == 8
    assert kv.allocate_slots(second, 4, hits) == [0, 1, 3]
    assert [b.ref_cnt for b in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    assert kv.prefix_cache_queries == 12 and kv.prefix_cache_hits == 8


def _parent_copied_on_write(kv: KVCacheManager, parent_id: str, child_id: str):
    """A parent of 11 tokens forked, then writing its 12th into the shared partial block 2: copied first."""
    parent, child = make_request(11, req_id=parent_id), make_request(11, req_id=child_id)
    kv.allocate_slots(parent, 11)
    parent.num_computed_tokens = child.num_computed_tokens = 11
    kv.fork(parent, child)
    kv.allocate_slots(parent, 1)
    return parent, child


def test_replaced_entries_are_taken_once_or_forgotten():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    _parent_copied_on_write(kv, "p", "c")
    assert kv.get_block_ids("p") == [0, 1, 3] and kv.get_block_ids("c") == [0, 1, 2]
    assert kv.take_replaced_blocks("p") == {2: 3}
    assert kv.take_replaced_blocks("p") == {}  # taken once: the runner patches its copy once
    _parent_copied_on_write(kv, "q", "d")
    kv.forget_replaced_blocks("q")  # its whole table goes out instead
    assert kv.get_block_ids("q") == [4, 5, 7] and kv.take_replaced_blocks("q") == {}
    kv.forget_replaced_blocks("nobody")  # a request with nothing replaced: nothing to forget


def test_core_calls_only_what_the_protocol_lists():
    """The scheduler and its collaborators reach a KV cache manager only through KVCacheManagerProtocol
    (so the bench baselines, which implement the protocol, plug in): checked on the source."""
    import ast
    from pathlib import Path

    from pagedllm.core.kv_cache_interface import KVCacheManagerProtocol

    allowed = {n for n in dir(KVCacheManagerProtocol) if not n.startswith("_")} | set(
        KVCacheManagerProtocol.__annotations__)
    core = Path(__file__).resolve().parents[2] / "pagedllm" / "core"
    used: dict[str, set[str]] = {}
    for path in core.glob("*.py"):
        if path.name in ("kv_cache_manager.py", "block_pool.py"):
            continue  # the paged manager itself
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
            if name in ("kv", "kv_cache_manager"):
                used.setdefault(node.attr, set()).add(path.name)
    assert {"allocate_slots", "trim", "num_free_blocks", "fork"} <= set(used)  # the check sees the calls
    assert {attr: files for attr, files in used.items() if attr not in allowed} == {}
