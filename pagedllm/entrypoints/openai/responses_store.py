"""Stored responses (`store: true`), for GET /v1/responses/{id} and `previous_response_id`.

Bounded twice, so no client can grow the server's memory: by count and by bytes (each entry's
size is its JSON's). Past either bound the least recently used entries go first. An entry is the
key's own: it is filed under the API key that created it, and another key finds nothing (404).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True)
class StoredResponse:
    response: dict
    """The response object as it was returned."""
    input_items: list[dict]
    """This request's input items, each with an id."""
    conversation: list[dict]
    """Every item of the conversation up to and including the output: what a next turn continues."""
    num_bytes: int = 0


class StoreObserver(Protocol):
    def record_store(self, num_entries: int, num_bytes: int, num_evicted: int) -> None: ...


class ResponseStore:
    """An LRU of StoredResponses keyed by (API key, response id); thread-safe."""

    def __init__(self, max_entries: int, max_bytes: int, observer: StoreObserver | None = None) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("the response store's bounds must be >= 0 (0 = store nothing)")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_evicted = 0
        self._entries: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()
        self._lock = threading.Lock()
        self._observer = observer

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, api_key: str | None, entry: StoredResponse) -> bool:
        """Store `entry`, evicting the least recently used; False if it alone exceeds the byte bound."""
        entry.num_bytes = len(json.dumps([entry.response, entry.input_items, entry.conversation],
                                         ensure_ascii=False, separators=(",", ":")).encode())
        if entry.num_bytes > self.max_bytes or self.max_entries == 0:
            return False
        key = (api_key, entry.response["id"])
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.num_bytes -= old.num_bytes
            self._entries[key] = entry
            self.num_bytes += entry.num_bytes
            while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.num_bytes -= evicted.num_bytes
                self.num_evicted += 1
            self._report()
        return True

    def get(self, api_key: str | None, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None: unknown, evicted, or another key's."""
        with self._lock:
            entry = self._entries.get((api_key, response_id))
            if entry is not None:
                self._entries.move_to_end((api_key, response_id))
            return entry

    def delete(self, api_key: str | None, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop((api_key, response_id), None)
            if entry is not None:
                self.num_bytes -= entry.num_bytes
                self._report()
            return entry is not None

    def _report(self) -> None:
        if self._observer is not None:
            self._observer.record_store(len(self._entries), self.num_bytes, self.num_evicted)
