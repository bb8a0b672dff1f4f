"""The prefix cache's disk tier: KV blocks evicted from memory kept in files, read back on a later miss.

A block's file is named by its prefix hash (core/block_hash.py: the SHA-256 chain over every token
before it, with the request's cache salt and LoRA adapter), so the same request finds it after an
eviction or a restart, and a tenant never finds another's. The files live under a folder named by a
fingerprint of everything the K/V depend on (model files, dtypes, block layout, engine version):
a store written by another model or configuration is never opened.

    DIR/
      <fingerprint>/               0700, one per model + configuration
        fingerprint.json           what the fingerprint covers, for a person reading the folder
        ab/abcdef....kv            0600, one block: header | token ids | payload
        ab/abcdef....r1.kv         with N tensor-parallel ranks: one file per rank's shard (its KV heads)

    header: magic "PKV1" | payload bytes (u64) | tokens (u32) | sha256(token ids | payload) (32 bytes)
    (a shard's checksum also covers its rank and N: a shard never passes for another rank's)

With N ranks a block is on disk only while all N shards are: the index holds whole blocks, a read
returns every shard or nothing (one missing or failing shard drops them all, and all N ranks
compute the block), and the payload is the shards joined in rank order.

A file is written to a temporary name and renamed (a reader never sees half a block); a read checks
the length, the checksum and the token ids before a byte reaches the cache, and a file that fails is
deleted and reported as a miss (the tokens are recomputed). Writes and reads each happen on a thread
of their own, off the step: `read_async` queues a block, `take_reads` collects what was read. Any OSError while writing (disk full, a read-only folder) switches the tier off with
one log line; the engine keeps serving from memory. Nothing a request sends becomes a path: names
are hex digests.

Pure Python (no torch): the payload is the bytes the worker copied out of a block (worker/kv_block_io.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path

from pagedllm.core.block_hash import BlockHash

logger = logging.getLogger(__name__)

MAGIC = b"PKV1"
MAX_PENDING_BYTES = 256 << 20
"""Blocks queued for the disk, at most: past it an evicted block is dropped rather than held in memory."""
_HEADER = struct.Struct("<4sQI32s")
SUFFIX = ".kv"


@dataclass(slots=True)
class DiskTierStats:
    """Counters of the disk tier since start (the gauges are read from the store)."""

    hit_blocks: int = 0
    """Blocks read back into the cache instead of recomputed."""
    miss_blocks: int = 0
    """Blocks looked up after a memory miss and not found (or found corrupt) on disk."""
    stored_blocks: int = 0
    evicted_blocks: int = 0
    """Files removed to keep the size limit."""
    corrupt_blocks: int = 0
    """Files that failed the length, checksum or token check (deleted, recomputed)."""
    load_seconds: float = 0.0
    store_seconds: float = 0.0


def fingerprint(facts: dict) -> str:
    """A short stable digest of what the K/V depend on (``facts``: JSON-able)."""
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class KVDiskStore:
    """Block files under ``root/<fingerprint>``, at most ``max_bytes`` of them (least recently used go first)."""

    def __init__(self, root: str | Path, facts: dict, max_bytes: int, payload_bytes: int, num_shards: int = 1) -> None:
        if max_bytes <= 0:
            raise ValueError(f"kv_disk_cache_size must be > 0 bytes, got {max_bytes}")
        if num_shards < 1 or payload_bytes % num_shards:
            raise ValueError(f"a KV block of {payload_bytes} bytes does not split into {num_shards} equal shards")
        self.max_bytes = max_bytes
        self.payload_bytes = payload_bytes
        """One whole block: every rank's shard, joined in rank order."""
        self.num_shards = num_shards
        """Tensor-parallel ranks: each rank's shard of a block is a file of its own."""
        self.stats = DiskTierStats()
        self.enabled = True
        self.closed = False
        self.disabled_reason: str | None = None
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> file bytes, least recent first
        self._pending: dict[BlockHash, tuple[tuple[int, ...], bytes]] = {}
        """Blocks queued and not yet written: a lookup finds them here (the disk may lag the evictions)."""
        self._pending_bytes = 0
        self.num_bytes = 0
        self.read_file: Callable[[Path], bytes] = Path.read_bytes
        """How the reader thread gets a block file's bytes (a test slows it down here)."""
        self._reads: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._num_reads_queued = 0
        """Reads asked for and not yet taken back (the scheduler's thread only)."""
        self.dir = Path(root).expanduser() / fingerprint({**facts, "payload_bytes": payload_bytes,
                                                          **({"num_shards": num_shards} if num_shards > 1 else {})})
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.dir, 0o700)
            (self.dir / "fingerprint.json").write_text(json.dumps(facts, sort_keys=True, indent=1, default=str))
            self._scan()
        except OSError as e:
            self.disable(f"cannot use {self.dir}: {e}")
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()
        self._reader = threading.Thread(target=self._read_loop, name="kv-disk-reader", daemon=True)
        self._reader.start()
        logger.info("KV disk tier: %s, %d blocks (%.1f MiB) found, limit %.1f MiB", self.dir, len(self._index),
                    self.num_bytes / 2**20, max_bytes / 2**20)

    # --- lookups (the scheduler's thread) ------------------------------------------------------

    def __contains__(self, block_hash: BlockHash) -> bool:
        return self.enabled and (block_hash in self._pending or block_hash in self._index)

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def read(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> bytes | None:
        """The block's payload, checked; None (counted as a miss) when absent or damaged."""
        if block_hash not in self:
            self.stats.miss_blocks += 1
            return None
        start = time.perf_counter()
        pending = self._pending.get(block_hash)
        if pending is not None and pending[0] == token_ids:
            self.stats.hit_blocks += 1
            self.stats.load_seconds += time.perf_counter() - start
            return pending[1]
        shards = []
        for rank, path in enumerate(self._paths(block_hash)):
            try:
                shards.append(self._check(self.read_file(path), token_ids, rank))
            except OSError:
                shards.append(None)
            if shards[-1] is None:  # one shard short: every rank computes the block
                self.stats.corrupt_blocks += 1
                self.stats.miss_blocks += 1
                self._forget(block_hash, delete=True)
                logger.warning("KV disk tier: %s is missing or failed its check; the block is recomputed", path.name)
                return None
        payload = b"".join(shards)
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        self.stats.hit_blocks += 1
        self.stats.load_seconds += time.perf_counter() - start
        return payload

    @property
    def num_reads_pending(self) -> int:
        """Reads asked for whose results `take_reads` has not returned yet."""
        return self._num_reads_queued

    def read_async(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """Queue a `read` for the reader thread; its result comes back from `take_reads`."""
        self._num_reads_queued += 1
        self._reads.put((block_hash, token_ids))

    def take_reads(self, timeout_s: float = 0.0) -> list[tuple[BlockHash, bytes | None]]:
        """The reads finished since the last call, as (hash, payload or None); waits up to ``timeout_s`` for a
        first one when none is ready and some are queued."""
        done = []
        try:
            if timeout_s > 0 and self._num_reads_queued:
                done.append(self._done.get(timeout=timeout_s))
            while True:
                done.append(self._done.get_nowait())
        except queue.Empty:
            pass
        self._num_reads_queued -= len(done)
        return done

    def _read_loop(self) -> None:
        while True:
            item = self._reads.get()
            if item is None:
                return
            try:
                payload = self.read(*item)
            except Exception as e:  # noqa: BLE001 - a failed read is a miss; the reader must outlive it
                logger.warning("KV disk tier: reading a block failed (%r); it is recomputed", e)
                payload = None
            self._done.put((item[0], payload))

    def _check(self, data: bytes, token_ids: tuple[int, ...], rank: int) -> bytes | None:
        if len(data) < _HEADER.size:
            return None
        magic, num_payload, num_tokens, digest = _HEADER.unpack_from(data)
        tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
        body = data[_HEADER.size:]
        if (magic != MAGIC or num_payload != self.payload_bytes // self.num_shards or num_tokens != len(token_ids)
                or len(body) != len(tokens) + num_payload or body[: len(tokens)] != tokens
                or hashlib.sha256(self._shard_tag(rank) + body).digest() != digest):
            return None
        return body[len(tokens):]

    def _shard_tag(self, rank: int) -> bytes:
        return struct.pack("<II", rank, self.num_shards) if self.num_shards > 1 else b""

    # --- stores (queued; written off the step) ----------------------------------------------------

    def store(self, block_hash: BlockHash, token_ids: tuple[int, ...], payload: bytes, wait: bool = False) -> None:
        """Queue a block for writing; dropped when the tier is off, the block is there, or (unless ``wait``)
        the queue is full."""
        if not self.enabled or block_hash in self:
            return
        if len(payload) != self.payload_bytes:
            raise ValueError(f"a KV block payload of {len(payload)} bytes, expected {self.payload_bytes}")
        if not wait and self._pending_bytes + len(payload) > MAX_PENDING_BYTES:
            return  # the disk is slower than the evictions: this block is recomputed if asked for again
        with self._lock:
            self._pending[block_hash] = (token_ids, payload)
            self._pending_bytes += len(payload)
        self._queue.put((block_hash, token_ids, payload))

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued block is written (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        """Finish the queued writes and stop the writer (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.flush()
        self._queue.put(None)
        self._reads.put(None)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self.enabled:
                    self._write(*item)
            except Exception as e:  # noqa: BLE001 - the writer must outlive any block's failure
                self.disable(f"a write failed: {e!r}")
            finally:
                if item is not None:
                    with self._lock:
                        if self._pending.pop(item[0], None) is not None:
                            self._pending_bytes -= len(item[2])
                self._queue.task_done()

    def _write(self, block_hash: BlockHash, token_ids: tuple[int, ...], payload: bytes) -> None:
        start = time.perf_counter()
        tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
        size = len(payload) // self.num_shards
        num_bytes = 0
        for rank, path in enumerate(self._paths(block_hash)):
            shard = payload[rank * size : (rank + 1) * size]
            digest = hashlib.sha256(self._shard_tag(rank) + tokens + shard).digest()
            data = _HEADER.pack(MAGIC, len(shard), len(token_ids), digest) + tokens + shard
            tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
            try:
                path.parent.mkdir(exist_ok=True, mode=0o700)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)  # atomic: a reader sees the old name's absence or the whole shard
            except OSError as e:
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:
                    pass
                self.disable(f"writing {path.name} failed: {e}")
                return
            num_bytes += len(data)
        with self._lock:  # indexed once every shard is there
            self._index[block_hash] = num_bytes
            self.num_bytes += num_bytes
        self.stats.stored_blocks += 1
        self.stats.store_seconds += time.perf_counter() - start
        self._evict_to_limit()

    # --- the folder ----------------------------------------------------------------------------

    def _path(self, block_hash: BlockHash, rank: int = 0) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / (name + (f".r{rank}" if self.num_shards > 1 else "") + SUFFIX)

    def _paths(self, block_hash: BlockHash) -> list[Path]:
        """The block's files, one per rank's shard, in rank order."""
        return [self._path(block_hash, rank) for rank in range(self.num_shards)]

    def _scan(self) -> None:
        """Index the blocks a previous run left whole (every shard there), oldest first; stray temporaries are
        removed."""
        found: dict[bytes, list[tuple[int, int]]] = {}
        for path in self.dir.glob("*/*"):
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
                continue
            stem = path.name.removesuffix(SUFFIX)
            rank = stem[66:] if self.num_shards > 1 and stem[64:66] == ".r" else "0"
            if not path.name.endswith(SUFFIX) or not rank.isdigit() or int(rank) >= self.num_shards:
                continue
            try:
                block_hash = bytes.fromhex(stem[:64])
                if path != self._path(block_hash, int(rank)):
                    continue
                stat = path.stat()
            except (OSError, ValueError):
                continue
            found.setdefault(block_hash, []).append((stat.st_mtime_ns, stat.st_size))
        blocks = [(max(t for t, _ in shards), h, sum(s for _, s in shards))
                  for h, shards in found.items() if len(shards) == self.num_shards]
        for _, block_hash, size in sorted(blocks):
            self._index[block_hash] = size
            self.num_bytes += size
        self._evict_to_limit()

    def _evict_to_limit(self) -> None:
        while self.num_bytes > self.max_bytes and self._index:
            with self._lock:
                block_hash = next(iter(self._index))
            self._forget(block_hash, delete=True)
            self.stats.evicted_blocks += 1

    def _forget(self, block_hash: BlockHash, delete: bool) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.num_bytes -= size
        if delete:
            for path in self._paths(block_hash):
                try:
                    path.unlink(missing_ok=True)
                except OSError:
                    pass

    def disable(self, reason: str) -> None:
        if self.enabled:
            logger.warning("KV disk tier switched off (%s); serving goes on from memory", reason)
        self.enabled = False
        self.disabled_reason = reason
