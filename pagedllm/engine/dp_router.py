"""Which data-parallel replica serves a request: least-loaded, or prefix affinity bounded by load.

Pure Python (no sockets, no processes): DPCoreClient asks `route()` and reports what it sent and
what finished, so the decisions are unit-testable with exact expectations.

    least-loaded:     the up replica with the fewest in-flight sequences; ties go round-robin
                      (so a trickle of one request at a time still alternates)
    prefix-affinity:  hash the prompt's first `num_affinity_blocks` full blocks with the prefix cache's
                      own chain (core/block_pool.py, the cache salt as extra key) and look the chain up
                      from its deepest block: the replica that last served the longest known prefix of
                      it holds those blocks most likely. It wins unless its load exceeds the least-loaded
                      replica's by more than `max_load_imbalance`; then least-loaded, so one hot prefix
                      cannot pile onto one replica.

Load is counted here, on the client side (sequences sent and not yet finished or aborted), not from
the cores' periodic stats: it is exact at the moment of the decision, where the stats lag a step.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.core.block_pool import BlockHash, hash_block_tokens, prefix_extra_keys


class RoutingPolicy(str, enum.Enum):
    LEAST_LOADED = "least-loaded"
    PREFIX_AFFINITY = "prefix-affinity"


class RouteReason(str, enum.Enum):
    """Why a replica was chosen (a label of the routing-decisions metric)."""

    LEAST_LOADED = "least_loaded"
    """Least-loaded policy, or a prompt with no full block to hash."""
    AFFINITY_HIT = "affinity_hit"
    """The replica that last served the prompt's leading blocks."""
    AFFINITY_MISS = "affinity_miss"
    """No replica is known to hold the leading blocks: least-loaded."""
    AFFINITY_OVERLOADED = "affinity_overloaded"
    """The affine replica was too far above the least-loaded one: least-loaded instead."""


class NoReplicaUpError(RuntimeError):
    """Every replica is down (the caller turns it into an EngineDeadError for this request)."""


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica: int
    reason: RouteReason


class DPRouter:
    """Routing state of `num_replicas` replicas: which are up, their loads, and the prefix table."""

    def __init__(self, num_replicas: int, policy: RoutingPolicy | str = RoutingPolicy.LEAST_LOADED,
                 block_size: int = 16, num_affinity_blocks: int = 4, max_load_imbalance: int = 8,
                 max_table_entries: int = 65536) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if num_affinity_blocks < 1:
            raise ValueError(f"num_affinity_blocks must be >= 1, got {num_affinity_blocks}")
        if max_load_imbalance < 0:
            raise ValueError(f"max_load_imbalance must be >= 0, got {max_load_imbalance}")
        self.num_replicas = num_replicas
        self.policy = RoutingPolicy(policy)
        self.block_size = block_size
        self.num_affinity_blocks = num_affinity_blocks
        self.max_load_imbalance = max_load_imbalance
        self.loads = [0] * num_replicas
        """In-flight sequences per replica (sent, not finished or aborted)."""
        self.up = [True] * num_replicas
        self._last_choice = num_replicas - 1  # so the first tie goes to replica 0
        self._table: OrderedDict[BlockHash, int] = OrderedDict()
        """Block hash -> the replica that last served a prompt through it (LRU-bounded)."""
        self._max_table_entries = max_table_entries

    # --- state ------------------------------------------------------------------------------

    def set_up(self, replica: int, up: bool) -> None:
        """Take a replica out of the routing set (it died: its load is gone with it) or back in."""
        self.up[replica] = up
        if not up:
            self.loads[replica] = 0
            for key in [k for k, r in self._table.items() if r == replica]:
                del self._table[key]  # a restarted replica starts with a cold cache

    def on_sent(self, replica: int, num_sequences: int = 1) -> None:
        self.loads[replica] += num_sequences

    def on_finished(self, replica: int, num_sequences: int = 1) -> None:
        self.loads[replica] = max(0, self.loads[replica] - num_sequences)

    @property
    def num_up(self) -> int:
        return sum(self.up)

    # --- decisions --------------------------------------------------------------------------

    def leading_block_hashes(self, prompt_token_ids: Sequence[int], cache_salt: str | None,
                             lora_cache_key: str | None = None) -> list[BlockHash]:
        """The prefix cache's hashes of the prompt's first (up to num_affinity_blocks) full blocks."""
        extra_keys = prefix_extra_keys(cache_salt, lora_cache_key)
        num_blocks = min(len(prompt_token_ids) // self.block_size, self.num_affinity_blocks)
        hashes: list[BlockHash] = []
        for i in range(num_blocks):
            block = prompt_token_ids[i * self.block_size:(i + 1) * self.block_size]
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, block, extra_keys))
        return hashes

    def route(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None,
              lora_cache_key: str | None = None) -> RouteDecision:
        """Choose an up replica for a prompt (does not count it as sent: call on_sent()).

        Under prefix affinity, a LoRA request's prefix is its adapter's own (as in the cores' caches),
        so requests of one adapter sharing a prompt gather on one replica, and never follow the base's.

        Raises NoReplicaUpError when every replica is down."""
        least = self._least_loaded()
        if self.policy is RoutingPolicy.LEAST_LOADED:
            return self._choose(least, RouteReason.LEAST_LOADED)
        hashes = self.leading_block_hashes(prompt_token_ids, cache_salt, lora_cache_key)
        if not hashes:
            return self._choose(least, RouteReason.LEAST_LOADED)
        affine = self._deepest_known(hashes)
        if affine is None:
            decision = self._choose(least, RouteReason.AFFINITY_MISS)
        elif self.loads[affine] - self.loads[least] > self.max_load_imbalance:
            decision = self._choose(least, RouteReason.AFFINITY_OVERLOADED)
        else:
            decision = self._choose(affine, RouteReason.AFFINITY_HIT)
        for block_hash in hashes:  # the chosen replica will hold these blocks now
            self._table[block_hash] = decision.replica
            self._table.move_to_end(block_hash)
        while len(self._table) > self._max_table_entries:
            self._table.popitem(last=False)
        return decision

    def _least_loaded(self) -> int:
        up = [i for i in range(self.num_replicas) if self.up[i]]
        if not up:
            raise NoReplicaUpError("no engine replica is up")
        min_load = min(self.loads[i] for i in up)
        # round-robin among the tied: the first after the last choice
        tied = [i for i in up if self.loads[i] == min_load]
        return min(tied, key=lambda i: (i - self._last_choice - 1) % self.num_replicas)

    def _deepest_known(self, hashes: list[BlockHash]) -> int | None:
        for block_hash in reversed(hashes):
            replica = self._table.get(block_hash)
            if replica is not None and self.up[replica]:
                return replica
        return None

    def _choose(self, replica: int, reason: RouteReason) -> RouteDecision:
        self._last_choice = replica
        return RouteDecision(replica, reason)
