"""The KV disk tier for an engine core: what its store's fingerprint covers, and the checks before it starts."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pagedllm.config import CacheConfig, EngineArgs
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_disk_store import KVDiskStore
from pagedllm.core.kv_disk_tier import DiskTier
from pagedllm.worker.interface import KVCacheInfo, ModelInfo

FINGERPRINT_VERSION = 1
"""Bumped whenever what a block file holds, or how K/V are computed, changes in a way the other facts miss."""


def attach_disk_tier(kv_cache_manager, cache_config: CacheConfig, engine_args: EngineArgs, model_info: ModelInfo,
                     kv_info: KVCacheInfo) -> DiskTier:
    """A store under ``cache_config.kv_disk_cache`` for this model and configuration, joined to the manager's pool
    (the scheduler is handed the tier: it holds requests while their blocks are read)."""
    if not isinstance(kv_cache_manager, KVCacheManager):
        raise ValueError("kv_disk_cache needs the paged KV cache manager")
    num_ranks = engine_args.parallel_config().tensor_parallel_size  # each rank's shard of a block: a file
    store = KVDiskStore(cache_config.kv_disk_cache, fingerprint_facts(engine_args, model_info, kv_info),
                        cache_config.kv_disk_cache_size, kv_info.bytes_per_block * num_ranks, num_shards=num_ranks)
    return DiskTier(store, kv_cache_manager)


def finish_disk_tier(tier: DiskTier, executor) -> None:
    """Keep the cached prefixes still in memory on disk too, then finish the writes (idempotent)."""
    if tier.store.closed:
        return
    read_blocks = getattr(executor, "read_kv_blocks", None)
    if read_blocks is not None:
        try:
            tier.persist(read_blocks)
        except Exception as e:  # noqa: BLE001 - the executor may already be gone at exit
            tier.store.disable(f"keeping the cached prefixes at shutdown failed: {e!r}")
    tier.store.close()


def fingerprint_facts(engine_args: EngineArgs, model_info: ModelInfo, kv_info: KVCacheInfo) -> dict:
    """Everything a block's K/V depend on, besides its tokens and prefix (those are in its hash): the model
    (its files' names, sizes and modification times, and its config), how it runs (dtypes, weight and
    activation formats, batch invariance), the block layout, and the engine's version."""
    from pagedllm.model.activation_format import for_model
    from pagedllm.version import __version__

    return {
        "version": FINGERPRINT_VERSION, "engine": __version__,
        "model": engine_args.model, "model_files": _files_identity(engine_args.model, model_info.model_path),
        "config": _config_digest(model_info.hf_config),
        "dtype": engine_args.dtype, "kv_cache_dtype": engine_args.kv_cache_dtype,
        "quantization": engine_args.quantization,
        "quant_activations": for_model(engine_args.quant_activations, engine_args.model, log=False),
        "gguf_dequantize": engine_args.gguf_dequantize, "batch_invariant": engine_args.batch_invariant,
        "speculative": repr(engine_args.speculative()),
        "block_size": kv_info.block_size, "bytes_per_block": kv_info.bytes_per_block,
        "num_kv_heads": kv_info.num_kv_heads,
        "tensor_parallel_size": engine_args.parallel_config().tensor_parallel_size,
    }


def _files_identity(model: str | None, model_path: str) -> list:
    """(name, size, mtime) of the model's weight sources: the GGUF file, or the directory's files."""
    paths = []
    for root in {model, model_path} - {None}:
        path = Path(root).expanduser()
        if path.is_file():
            paths.append(path)
        elif path.is_dir():
            paths.extend(p for p in sorted(path.iterdir()) if p.is_file())
    identity = []
    for p in paths:
        stat = p.stat()
        identity.append([str(p.resolve()), stat.st_size, stat.st_mtime_ns])
    return identity


def _config_digest(hf_config) -> str:
    text = hf_config.to_json_string(use_diff=False) if hasattr(hf_config, "to_json_string") else json.dumps(
        vars(hf_config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
