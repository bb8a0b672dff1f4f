"""create_executor: how the engine core runs a step, chosen from the arguments. One scheduler, one or many shards.

* ``UniprocExecutor`` (uniproc_executor.py) loads the model and runs a ``ModelRunner`` in the engine's own
  process (tensor_parallel_size=1).
* ``MultiprocTPExecutor`` (tp_executor.py) drives N worker processes, one tensor-parallel rank each.

Both size the KV cache in ``initialize_kv_cache`` (the contract is in interface.py; the arithmetic in
kv_cache.py and kv_cache_sizing.py) and report it as a ``KVCacheInfo``.
"""

from __future__ import annotations

from pathlib import Path

from pagedllm.config import EngineArgs, ParallelConfig
from pagedllm.model.loader import gguf_weights_source, prepare_model_dir
from pagedllm.worker.gpu import resolve_device, resolve_dtype
from pagedllm.worker.interface import Executor
from pagedllm.worker.kv_cache import resolve_kv_cache_dtype
from pagedllm.worker.tp_executor import MultiprocTPExecutor
from pagedllm.worker.uniproc_executor import UniprocExecutor


def create_executor(engine_args: EngineArgs, parallel_config: ParallelConfig) -> Executor:
    """The executor for these arguments, its model loaded (weights only where they run)."""
    device = resolve_device(engine_args.device)
    dtype = resolve_dtype(engine_args.dtype, device)
    # Refused here, before any weights load, when the device or TP setup cannot run it.
    resolve_kv_cache_dtype(engine_args.kv_cache_dtype, dtype, device, parallel_config.tensor_parallel_size,
                           engine_args.attention_backend)
    # The executors take the frozen configs, never the mutable arguments.
    model_config, device_config = engine_args.model_config(), engine_args.device_config()
    lora_config, speculative = engine_args.lora_config(), engine_args.speculative()
    if parallel_config.tensor_parallel_size == 1:
        return UniprocExecutor(model_config, device_config, lora_config, speculative, device, dtype)
    if speculative is not None and speculative.method == "draft_model":
        raise ValueError('speculative decoding with a draft model ("method": "draft_model") is not supported '
                         "with tensor_parallel_size > 1 yet; use \"ngram\" or a single rank")
    if device.type != "cpu":
        raise ValueError("tensor parallelism runs on the CPU (gloo) so far; pass device='cpu' (--device cpu)")
    return MultiprocTPExecutor(model_config, device_config, lora_config, parallel_config, dtype)


def prepare_model_files(engine_args: EngineArgs) -> Path:
    """The model directory the executor will load, converted (a GGUF's, with float32 weights only where they are
    run) and its config resolved, here: ``loader.prepare_model_dir``."""
    device = resolve_device(engine_args.device)
    dtype = resolve_dtype(engine_args.dtype, device)
    gguf = gguf_weights_source(engine_args.model, dtype, device, engine_args.gguf_dequantize)
    return prepare_model_dir(engine_args.model, weights=gguf is None)
