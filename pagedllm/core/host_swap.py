"""Swap space: host blocks holding preempted requests' KV, which are free and which each request holds.

The KV cache manager moves a request's device blocks here (``swap_out``) and back (``swap_in``); this keeps only
the host side's ids. A windowed table's null entries are not swapped: -1 stands for each in a host table.
"""

from __future__ import annotations

NULL_ENTRY = -1
"""A host table's entry for a null device entry (a block freed behind the sliding window): nothing was copied."""


class HostSwapSpace:
    """``num_blocks`` host block ids, handed out last-freed-first, and each swapped-out request's host table."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        """req_id -> its host blocks, in block-table order (NULL_ENTRY where its device entry was null): a request
        is swapped out while it has an entry here."""
        self.num_used_blocks = 0
        """Host blocks held: a count kept, so the gauges read it without a call."""

    def fits(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_blocks)

    def take(self, req_id: str, num_null: int, num_blocks: int) -> list[int]:
        """A host table for ``req_id``: ``num_null`` null entries, then ``num_blocks`` free host blocks (the
        caller checked they ``fits``)."""
        table = [NULL_ENTRY] * num_null + [self.free_blocks.pop() for _ in range(num_blocks)]
        self.tables[req_id] = table
        self.num_used_blocks += num_blocks
        return table

    def release(self, req_id: str) -> None:
        """Give back ``req_id``'s host blocks (none held: nothing to do)."""
        released = [h for h in reversed(self.tables.pop(req_id, [])) if h != NULL_ENTRY]
        self.free_blocks.extend(released)
        self.num_used_blocks -= len(released)

    def problems(self) -> list[str]:
        """With no request alive: what is still held (empty = fine)."""
        if self.tables or len(self.free_blocks) != self.num_blocks:
            return [f"host (swap) blocks still held: {sorted(self.tables)}"]
        return []
