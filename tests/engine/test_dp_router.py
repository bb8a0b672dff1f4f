"""DPRouter decisions with exact expectations (no processes)."""

from __future__ import annotations

import pytest

from pagedllm.core.block_pool import extend_block_hashes
from pagedllm.engine.dp_router import DPRouter, NoReplicaUpError, RouteReason


def prompt(group: int, suffix: int, num_prefix_blocks: int = 3, block_size: int = 4) -> list[int]:
    """num_prefix_blocks full blocks shared by a group, then one block unique to the request."""
    return [1000 * group + i for i in range(num_prefix_blocks * block_size)] + [suffix] * block_size


def test_least_loaded_picks_fewest_in_flight_and_alternates_on_ties():
    router = DPRouter(3)
    chosen = []
    for _ in range(3):  # all idle: round-robin 0, 1, 2
        d = router.route([1, 2, 3])
        assert d.reason is RouteReason.LEAST_LOADED
        chosen.append(d.replica)
    assert chosen == [0, 1, 2]
    router.on_sent(0, 2)
    router.on_sent(1, 1)
    assert router.route([]).replica == 2  # the only idle one
    router.on_sent(2, 1)
    assert router.route([]).replica == 1  # 1 and 2 tie; 2 was chosen last, so the turn wraps to 1
    router.on_finished(0, 2)
    assert router.route([]).replica == 0
    assert router.loads == [0, 1, 1]


def test_down_replica_leaves_the_routing_set_and_rejoins():
    router = DPRouter(2)
    router.on_sent(1, 5)
    router.set_up(0, False)
    assert [router.route([]).replica for _ in range(3)] == [1, 1, 1]  # despite its load
    router.set_up(1, False)
    with pytest.raises(NoReplicaUpError):
        router.route([])
    router.set_up(0, True)
    assert router.route([]).replica == 0
    assert router.loads == [0, 0]  # a replica that went down took its load with it


def test_leading_block_hashes_are_the_prefix_caches_and_include_the_salt():
    router = DPRouter(2, "prefix-affinity", block_size=4, num_affinity_blocks=2)
    tokens = list(range(13))
    expected: list[bytes] = []
    extend_block_hashes(expected, tokens, 4, ("tenant-a",))
    assert router.leading_block_hashes(tokens, "tenant-a") == expected[:2]
    assert router.leading_block_hashes(tokens, None) != expected[:2]
    assert router.leading_block_hashes(tokens[:3], None) == []  # no full block


def test_prefix_affinity_follows_the_group_and_splits_groups():
    router = DPRouter(2, "prefix-affinity", block_size=4, num_affinity_blocks=4, max_load_imbalance=2)
    a0 = router.route(prompt(1, 1))
    assert (a0.replica, a0.reason) == (0, RouteReason.AFFINITY_MISS)
    router.on_sent(0)
    b0 = router.route(prompt(2, 1))
    assert (b0.replica, b0.reason) == (1, RouteReason.AFFINITY_MISS)  # least-loaded for a new prefix
    router.on_sent(1)
    # the group's 4th block differs per request: the deepest known hash (block 3) still matches
    for suffix in (2, 3):
        d = router.route(prompt(1, suffix))
        assert (d.replica, d.reason) == (0, RouteReason.AFFINITY_HIT)
        router.on_sent(0)
    d = router.route(prompt(2, 9))
    assert (d.replica, d.reason) == (1, RouteReason.AFFINITY_HIT)


def test_prefix_affinity_is_bounded_by_load():
    router = DPRouter(2, "prefix-affinity", block_size=4, max_load_imbalance=2)
    assert router.route(prompt(1, 0)).replica == 0
    router.on_sent(0, 2)  # 2 - 0 <= 2: still affine
    d = router.route(prompt(1, 1))
    assert (d.replica, d.reason) == (0, RouteReason.AFFINITY_HIT)
    router.on_sent(0, 1)  # 3 - 0 > 2: overloaded
    d = router.route(prompt(1, 2))
    assert (d.replica, d.reason) == (1, RouteReason.AFFINITY_OVERLOADED)
    # replica 1 now holds the chain too (it will have computed those blocks): it is the affine one
    router.on_sent(1)
    d = router.route(prompt(1, 3))
    assert (d.replica, d.reason) == (1, RouteReason.AFFINITY_HIT)


def test_salt_separates_affinity_and_a_dead_replica_forgets_its_prefixes():
    router = DPRouter(2, "prefix-affinity", block_size=4)
    assert router.route(prompt(1, 0), "tenant-a").replica == 0
    router.on_sent(0)
    d = router.route(prompt(1, 0), "tenant-b")  # same tokens, other salt: no shared blocks
    assert (d.replica, d.reason) == (1, RouteReason.AFFINITY_MISS)
    router.on_sent(1)
    router.set_up(0, False)
    router.set_up(0, True)  # restarted, cold cache
    d = router.route(prompt(1, 1), "tenant-a")
    assert (d.replica, d.reason) == (0, RouteReason.AFFINITY_MISS)


def test_least_loaded_policy_ignores_prefixes():
    router = DPRouter(2, "least-loaded", block_size=4)
    assert [router.route(prompt(1, 0)).replica for _ in range(4)] == [0, 1, 0, 1]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        DPRouter(0)
    with pytest.raises(ValueError):
        DPRouter(2, "random")
    with pytest.raises(ValueError):
        DPRouter(2, max_load_imbalance=-1)


def test_an_adapters_prefix_is_its_own_so_it_neither_follows_nor_moves_the_bases():
    from pagedllm.core.block_pool import prefix_extra_keys
    from pagedllm.lora.request import LoRARequest

    adapter = LoRARequest("ad", 1, "/adapters/ad").cache_key
    router = DPRouter(2, "prefix-affinity", block_size=4, num_affinity_blocks=4, max_load_imbalance=8)
    tokens = prompt(1, 1)
    expected: list[bytes] = []
    extend_block_hashes(expected, tokens, 4, prefix_extra_keys("salt", adapter))
    assert router.leading_block_hashes(tokens, "salt", adapter) == expected[:4]  # what the core's cache holds

    base = router.route(prompt(1, 1))
    router.on_sent(base.replica)
    first = router.route(prompt(1, 2), lora_cache_key=adapter)  # same tokens, but the base's blocks are no hit
    assert first.reason is RouteReason.AFFINITY_MISS and first.replica != base.replica
    router.on_sent(first.replica)
    again = router.route(prompt(1, 3), lora_cache_key=adapter)
    assert (again.replica, again.reason) == (first.replica, RouteReason.AFFINITY_HIT)
    assert router.route(prompt(1, 4)).replica == base.replica  # the base still follows its own
