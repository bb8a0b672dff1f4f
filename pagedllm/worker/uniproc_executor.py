"""UniprocExecutor: the whole model and its ModelRunner in the engine core's own process (tensor_parallel_size=1)."""

from __future__ import annotations

import torch

from pagedllm.config import CacheConfig, EngineArgs, SchedulerConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.model.layers.rotary import limit_rotary_positions
from pagedllm.model.loader import load_model
from pagedllm.worker.draft_proposer import DraftProposer, load_draft_model
from pagedllm.worker.interface import Executor, KVCacheInfo, ModelInfo
from pagedllm.worker.kv_cache import KVCacheSpec, num_kv_blocks, resolve_kv_cache_dtype
from pagedllm.worker.kv_cache_sizing import kv_cache_info, profile_num_kv_blocks, shared_sliding_window
from pagedllm.worker.model_runner import ModelRunner


def make_lora_manager(model, config):
    """The LoRA manager patching `model`'s linears with `config`'s slots; None when LoRA is off."""
    if config is None:
        return None
    from pagedllm.lora.manager import LoRAManager

    return LoRAManager(model, config.max_loras, config.max_lora_rank, config.num_cpu_loras)


class UniprocExecutor(Executor):
    """The whole model in this process."""

    def __init__(self, engine_args: EngineArgs, device: torch.device, dtype: torch.dtype) -> None:
        self.engine_args = engine_args
        self.device = device
        self.dtype = dtype
        if engine_args.num_threads is not None:  # before loading: weight conversion runs on these threads
            torch.set_num_threads(engine_args.num_threads)
        self.loaded = load_model(engine_args.model, dtype=dtype, device=str(device),
                                 gguf_dequantize=engine_args.gguf_dequantize, quantization=engine_args.quantization,
                                 quant_activations=engine_args.quant_activations)
        self.model_info = ModelInfo.from_loaded(self.loaded)
        self.lora = make_lora_manager(self.loaded.model, engine_args.lora_config())
        """The LoRA adapters' slots, made before CUDA profiling so the KV cache leaves room for them."""
        speculative = engine_args.speculative()
        self.draft_loaded = None
        """The draft model of speculative 'draft_model' (loaded before CUDA profiling counts the weights)."""
        if speculative is not None and speculative.method == "draft_model":
            self.draft_loaded = load_draft_model(speculative.model, self.model_info.vocab_size, dtype, str(device),
                                                 engine_args.quant_activations)
        self.kv_spec: KVCacheSpec | None = None
        self.runner: ModelRunner | None = None

    def initialize_kv_cache(self, cache_config: CacheConfig, scheduler_config: SchedulerConfig) -> KVCacheInfo:
        model = self.loaded.model
        # Positions from max_model_len on never run: the rotary tables need not cover the model's whole context.
        for served in (model, *([self.draft_loaded.model] if self.draft_loaded is not None else [])):
            limit_rotary_positions(served, scheduler_config.max_model_len)
        kv_dtype = resolve_kv_cache_dtype(self.engine_args.kv_cache_dtype, self.dtype, self.device)
        self.kv_spec = spec = KVCacheSpec.for_model(self.model_info.hf_config, cache_config.block_size, kv_dtype)
        draft_spec = None
        if self.draft_loaded is not None:  # the draft's cache shares the block ids, so also their element type
            draft_spec = KVCacheSpec.for_model(self.draft_loaded.hf_config, cache_config.block_size, kv_dtype)
        bytes_per_block = spec.bytes_per_block + (draft_spec.bytes_per_block if draft_spec is not None else 0)
        profiled = None
        if self.device.type == "cuda" and cache_config.num_kv_blocks is None:
            profiled = profile_num_kv_blocks(  # CUDA: what gpu_memory_utilization leaves, not kv_cache_memory
                model, bytes_per_block, scheduler_config.max_num_batched_tokens,
                scheduler_config.max_num_seqs, self.engine_args.gpu_memory_utilization, self.device,
            )
        num_blocks, num_host_blocks = num_kv_blocks(spec, cache_config, profiled, draft_spec)
        args = self.engine_args
        draft = None
        if self.draft_loaded is not None:
            draft = DraftProposer(self.draft_loaded.model, draft_spec, num_blocks, num_host_blocks, self.device)
        self.runner = ModelRunner(
            model, vocab_size=self.model_info.vocab_size, kv_spec=spec, num_blocks=num_blocks, seed=args.seed,
            num_host_blocks=num_host_blocks, device=self.device, attention_backend=args.attention_backend,
            cuda_graphs=None if args.enforce_eager else scheduler_config, load_tokenizer=lambda: self.loaded.tokenizer,
            draft=draft, lora=self.lora, batch_invariant=args.batch_invariant,
        )
        # a draft model reads the same block tables, so its layers must share the window too
        window = shared_sliding_window(model, *([self.draft_loaded.model] if self.draft_loaded is not None else []))
        return kv_cache_info(spec, num_blocks, num_host_blocks, draft_spec, sliding_window=window)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "initialize_kv_cache() first"
        return self.runner.execute_model(sched)
