"""UniprocExecutor: the whole model and its ModelRunner in the engine core's own process (tensor_parallel_size=1)."""

from __future__ import annotations

import logging

import torch

from pagedllm.config import CacheConfig, DeviceConfig, LoRAConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.model import batch_invariant
from pagedllm.errors import ModelLoadError
from pagedllm.model.layers import bf16_matmul
from pagedllm.model.layers.rotary import limit_rotary_positions
from pagedllm.model.loader import load_model
from pagedllm.worker.draft_proposer import DraftProposer, load_draft_model
from pagedllm.worker.interface import Executor, KVCacheInfo, ModelInfo
from pagedllm.worker.kv_cache import KVCacheSpec, num_kv_blocks, resolve_kv_cache_dtype
from pagedllm.worker.kv_cache_sizing import (
    kv_cache_info,
    profile_num_kv_blocks,
    shared_sliding_window,
    with_default_kv_memory,
)
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def make_lora_manager(model, config):
    """The LoRA manager patching `model`'s linears with `config`'s slots; None when LoRA is off."""
    if config is None:
        return None
    from pagedllm.lora.manager import LoRAManager

    return LoRAManager(model, config.max_loras, config.max_lora_rank, config.num_cpu_loras)


def make_pooling_runner(loaded, model_config: ModelConfig, device: torch.device):
    """The PoolingRunner of a model served with runner 'pooling' or 'both'; None for 'generate'. A head-less
    checkpoint cannot generate ('generate', 'both': ModelLoadError)."""
    if model_config.runner != "pooling":
        if not getattr(loaded.model, "has_lm_head", True):
            raise ModelLoadError(f"{loaded.model_path} is a {type(loaded.model).__name__} checkpoint, without a "
                                 f"language-model head: it cannot generate; load it with runner='pooling' "
                                 f"(--runner pooling) to embed with it")
        if model_config.runner == "generate":
            return None
    from pagedllm.model.layers.pooler import Pooler, ScoreHead
    from pagedllm.config.embedder import embedder_for
    from pagedllm.worker.pooling import PoolingRunner

    config = embedder_for(model_config.runner, loaded.model_path, model_config.model)
    if config.score_activation is not None:  # a cross-encoder
        return PoolingRunner(ScoreHead(loaded.model, config))
    return PoolingRunner(Pooler(config, loaded.hf_config.hidden_size).to(device))


class UniprocExecutor(Executor):
    """The whole model in this process."""

    def __init__(self, model_config: ModelConfig, device_config: DeviceConfig, lora_config: LoRAConfig | None,
                 speculative: SpeculativeConfig | None, device: torch.device, dtype: torch.dtype) -> None:
        self.model_config = model_config
        self.device_config = device_config
        self.device = device
        self.dtype = dtype
        if device_config.num_threads is not None:  # before loading: weight conversion runs on these threads
            torch.set_num_threads(device_config.num_threads)
        with batch_invariant.building(device_config.batch_invariant):  # the layers choose their kernels when built
            self.loaded = load_model(model_config.model, dtype=dtype, device=str(device),
                                     gguf_dequantize=model_config.gguf_dequantize,
                                     quantization=model_config.quantization,
                                     quant_activations=model_config.quant_activations)
        self.model_info = ModelInfo.from_loaded(self.loaded, device.type)
        use_bf16_matmul, why = bf16_matmul.choose(model_config.dtype, model_config.runner, device,
                                                      scores=hasattr(self.loaded.model, "classify"))
        if use_bf16_matmul:
            bf16_matmul.apply(self.loaded.model)
        if why:
            logger.info(why)
        self.pooling = make_pooling_runner(self.loaded, model_config, device)
        """The pooling head (runner 'pooling'), built before the KV cache is sized; None when generating."""
        self.lora = make_lora_manager(self.loaded.model, lora_config)
        """The LoRA adapters' slots, made before CUDA profiling so the KV cache leaves room for them."""
        self.draft_loaded = None
        """The draft model of speculative 'draft_model' (loaded before CUDA profiling counts the weights)."""
        if speculative is not None and speculative.method == "draft_model":
            self.draft_loaded = load_draft_model(speculative.model, self.model_info.vocab_size, dtype, str(device),
                                                 model_config.quant_activations)
        self.kv_spec: KVCacheSpec | None = None
        self.runner: ModelRunner | None = None

    def initialize_kv_cache(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig) -> KVCacheInfo:
        model = self.loaded.model
        # Positions from max_model_len on never run: the rotary tables need not cover the model's whole context.
        for served in (model, *([self.draft_loaded.model] if self.draft_loaded is not None else [])):
            limit_rotary_positions(served, scheduler_config.max_model_len)
        kv_dtype = resolve_kv_cache_dtype(self.device_config.kv_cache_dtype, self.dtype, self.device)
        if not getattr(model, "uses_kv_cache", True):
            return self._initialize_without_kv(cache_config, scheduler_config, kv_dtype)
        self.kv_spec = spec = KVCacheSpec.for_model(self.model_info.hf_config, cache_config.block_size, kv_dtype)
        draft_spec = None
        if self.draft_loaded is not None:  # the draft's cache shares the block ids, so also their element type
            draft_spec = KVCacheSpec.for_model(self.draft_loaded.hf_config, cache_config.block_size, kv_dtype)
        bytes_per_block = spec.bytes_per_block + (draft_spec.bytes_per_block if draft_spec is not None else 0)
        profiled = None
        if self.device.type == "cuda" and cache_config.num_kv_blocks is None:
            profiled = profile_num_kv_blocks(  # CUDA: what gpu_memory_utilization leaves, not kv_cache_memory
                model, bytes_per_block, scheduler_config.max_num_batched_tokens,
                scheduler_config.max_num_seqs, self.device_config.gpu_memory_utilization, self.device,
            )
        if profiled is None:
            cache_config = with_default_kv_memory(cache_config, bytes_per_block, scheduler_config.max_model_len,
                                                  self.model_config.model)
        num_blocks, num_host_blocks = num_kv_blocks(spec, cache_config, profiled, draft_spec)
        args = self.device_config
        draft = None
        if self.draft_loaded is not None:
            draft = DraftProposer(self.draft_loaded.model, draft_spec, num_blocks, num_host_blocks, self.device)
        self._use_runner(ModelRunner(
            model, vocab_size=self.model_info.vocab_size, kv_spec=spec, num_blocks=num_blocks, seed=args.seed,
            num_host_blocks=num_host_blocks, device=self.device, attention_backend=args.attention_backend,
            cuda_graphs=None if args.enforce_eager else scheduler_config, load_tokenizer=lambda: self.loaded.tokenizer,
            draft=draft, lora=self.lora, batch_invariant=args.batch_invariant, pooling=self.pooling,
        ))
        # a draft model reads the same block tables, so its layers must share the window too
        window = shared_sliding_window(model, *([self.draft_loaded.model] if self.draft_loaded is not None else []))
        return kv_cache_info(spec, num_blocks, num_host_blocks, draft_spec, sliding_window=window)

    def _initialize_without_kv(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                               kv_dtype: torch.dtype) -> KVCacheInfo:
        """An encoder keeps no K/V: the scheduler still counts its tokens in blocks (the same admission,
        limits and metrics as a decoder), but no tensor backs them. Enough blocks for max_num_seqs
        sequences of max_model_len, unless num_kv_blocks says otherwise."""
        self.kv_spec = spec = KVCacheSpec(num_layers=0, num_kv_heads=0, head_dim=0, block_size=cache_config.block_size,
                                          dtype=kv_dtype)
        blocks_per_seq = -(-scheduler_config.max_model_len // spec.block_size)
        num_blocks = cache_config.num_kv_blocks or scheduler_config.max_num_seqs * blocks_per_seq
        args = self.device_config
        self._use_runner(ModelRunner(
            self.loaded.model, vocab_size=self.model_info.vocab_size, kv_spec=spec, num_blocks=num_blocks,
            seed=args.seed, num_host_blocks=0, device=self.device, attention_backend=args.attention_backend,
            cuda_graphs=None, batch_invariant=False, pooling=self.pooling))
        return kv_cache_info(spec, num_blocks, 0)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Only before ``initialize_kv_cache``: that makes the runner and puts its own ``execute_model`` in
        this method's place, so the engine core's step goes straight to the runner."""
        raise RuntimeError("initialize_kv_cache() first")

    def _use_runner(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.execute_model = runner.execute_model  # nothing to add in one process: no hop through here

    def read_kv_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Blocks' K/V as bytes (the KV disk tier keeps the cached prefixes at shutdown)."""
        return [] if self.runner is None else self.runner.read_kv_blocks(block_ids)
