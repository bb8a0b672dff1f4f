"""The Llama-like decoder over flat token batches and paged KV caches, and what varies around it.

``forward(input_ids [T], positions [T]) -> hidden_states [T, hidden]``; the attention layers find
the step's metadata and KV caches in the forward context. Llama, Mistral and Qwen2 are this file;
each other Llama-like architecture is a short file (qwen3.py, gemma.py, phi3.py, moe.py) that
states its differences as a ``DecoderSpec`` (decoder_spec.py: norms, q/k norm, soft-capping, sliding
windows, rotary per layer type, embedding scale) and, where needed, its MLP (``make_mlp``) and checkpoint
names (``hf_weights``; checkpoint_weights.py fits the named tensors into the fused parameters). Handled here for all: GQA, ``head_dim`` from the config, q/k/v bias, tied
embeddings, rope scaling, sliding-window layers (Mistral's, Qwen2's ``layer_types``). Tensor
parallelism comes from pagedllm.distributed (set before the model is built): each rank builds only
its shard.
"""

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_rank, get_tp_size
from pagedllm.distributed.shapes import check_config_tp_size, head_dim_of as _head_dim
from pagedllm.model import checkpoint_weights
from pagedllm.model.attention.layer import Attention
from pagedllm.model.decoder_spec import DecoderSpec
from pagedllm.model.forward_context import get_lora_segments
from pagedllm.model.layers import fused_decoder
from pagedllm.model.layers.activation import gated_activation
from pagedllm.model.layers.direct_children import DirectChildren
from pagedllm.model.layers.embedding import LMHead, VocabEmbedding
from pagedllm.model.layers.greedy_head import GreedyFallback
from pagedllm.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model.layers.rotary import RotaryEmbedding


def llama_spec(config) -> DecoderSpec:
    """Llama, Mistral, Qwen2 (and Qwen3's base): bias and sliding window as the config says."""
    attention_bias = bool(getattr(config, "attention_bias", False))
    layer_types = getattr(config, "layer_types", None)
    return DecoderSpec(
        qkv_bias=attention_bias or config.model_type == "qwen2",
        o_bias=attention_bias,
        sliding_window=getattr(config, "sliding_window", None),
        layer_types=tuple(layer_types) if layer_types is not None else None,
    )


class LlamaAttention(DirectChildren):
    def __init__(self, config, layer_idx: int, spec: DecoderSpec, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(config)
        tp = dict(tp_size=get_tp_size(), tp_rank=get_tp_rank())
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, bias=spec.qkv_bias, **tp
        )
        self.o_proj = RowParallelLinear(self.num_heads * self.head_dim, config.hidden_size, bias=spec.o_bias, **tp)
        self.rotary = rotary  # shared by all layers (of one layer type)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = spec.norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = spec.norm(self.head_dim, config.rms_norm_eps)
        # This rank's heads: [T, H/tp, D] queries over [T, Hkv/tp (at least 1), D] keys and values. Kept as
        # plain ints: reading them off qkv_proj goes through nn.Module.__getattr__ at every step.
        self.num_local_heads = self.qkv_proj.num_heads
        self.num_local_kv_heads = self.qkv_proj.num_kv_heads
        scale = spec.query_scale if spec.query_scale is not None else self.head_dim**-0.5
        self.attn = Attention(layer_idx, self.num_local_heads, self.num_local_kv_heads, self.head_dim, scale,
                              sliding_window=spec.window_of(layer_idx), softcap=spec.attn_softcap)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # [T, (H + 2*Hkv) * D]
        if self.qk_norm:
            H, Hkv, D = self.num_local_heads, self.num_local_kv_heads, self.head_dim
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
            q = self.rotary.rotate(self.q_norm(q.view(num_tokens, H, D)), cos_sin)  # [T, H, D]
            k = self.rotary.rotate(self.k_norm(k.view(num_tokens, Hkv, D)), cos_sin)  # [T, Hkv, D]
            v = v.view(num_tokens, Hkv, D)
        else:
            # [T, H, D], [T, Hkv, D], [T, Hkv, D]; queries and keys rotated
            q, k, v = self.rotary.rotate_qkv(qkv, cos_sin, self.num_local_heads, self.num_local_kv_heads)
        out = self.attn(q, k, v)  # [T, H, D]
        del qkv, q, k, v  # dead once attended: a long step's o_proj output need not sit beside them
        return self.o_proj(out.reshape(num_tokens, -1))


class LlamaMLP(DirectChildren):
    def __init__(self, config, spec: DecoderSpec, intermediate_size: int | None = None):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        intermediate_size = intermediate_size or config.intermediate_size
        tp = dict(tp_size=get_tp_size(), tp_rank=get_tp_rank())
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [intermediate_size] * 2, bias=bias, **tp
        )
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size, bias=bias, **tp)
        self.act = gated_activation(spec.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]. A step longer than MLP_WORKSPACE_BYTES runs in row slices, each writing its
        output over its own rows of a contiguous x (read just before), so callers pass an x they do not read again
        (the post-attention norm's output)."""
        num_tokens = x.shape[0]
        gate_up_row_bytes = self.gate_up_proj.output_size_per_partition * x.element_size()
        rows = max(1, MLP_WORKSPACE_BYTES // gate_up_row_bytes)
        if num_tokens <= rows or x.dim() != 2 or get_lora_segments():  # LoRA's segments index the whole step
            return self.down_proj(self.act(self.gate_up_proj(x)))
        out = x if x.is_contiguous() else x.new_empty(num_tokens, self.down_proj.output_size)  # [T, hidden]
        for start in range(0, num_tokens, rows):
            out[start : start + rows] = self.down_proj(self.act(self.gate_up_proj(x[start : start + rows])))
        return out


MLP_WORKSPACE_BYTES = 16 << 20
"""Most bytes of the MLP's gate/up output at once: a longer step runs its MLP in row slices. A 1B model's
2048-token step otherwise holds 128 MiB of gate/up and 64 MiB of activation per layer (slices of 256 rows:
16 + 8 MiB; no slower than 512 on the Q4_0 1B, docs/benchmarks.md "Memory at the 1B shape"). A row's result may differ only in
summation order where a kernel blocks by the number of rows
(bit-equal on the 1B Q4_0 one; docs/benchmarks.md "Memory at the 1B shape")."""


class LlamaDecoderLayer(DirectChildren):
    """Pre-norm block; with ``sandwich_norms`` (Gemma) the attention and MLP outputs are normed too
    before each joins the residual stream::

        h = x + [post_attention_norm](attn(input_norm(x)))
        out = h + [post_feedforward_norm](mlp(pre_feedforward_norm(h)))

    (Llama's ``post_attention_layernorm`` is the pre-MLP norm; Gemma's is the post-attention one.)
    """

    def __init__(self, config, layer_idx: int, spec: DecoderSpec, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, spec, rotary)
        self.mlp = mlp
        norm = spec.norm
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.sandwich_norms = spec.sandwich_norms
        if spec.sandwich_norms:
            self.pre_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention and MLP output, residual stream before it); their sum is the layer's output."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(cos_sin, hidden_states)
        if self.sandwich_norms:
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
            return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def fused_parts(self) -> fused_decoder.DecoderLayerParts | str:
        """This layer for the fused decoder call: its parts, or why it is not a plain pre-norm block there (the
        call runs exactly ``forward`` above, so a subclass, another MLP or the optional norms keep the per-op path)."""
        attn, mlp = self.self_attn, self.mlp
        if type(self) is not LlamaDecoderLayer or type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
            return f"{type(self).__name__} / {type(attn).__name__} / {type(mlp).__name__} layers"
        if self.sandwich_norms or attn.qk_norm:
            return "sandwich norms or q/k norms"
        return fused_decoder.DecoderLayerParts(
            self.input_layernorm, attn.qkv_proj, attn.attn, attn.o_proj, self.post_attention_layernorm,
            mlp.gate_up_proj, mlp.act, mlp.down_proj, attn.num_local_heads, attn.num_local_kv_heads, attn.head_dim)


class LlamaModel(DirectChildren):
    def __init__(self, config, spec: DecoderSpec, make_mlp):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, get_tp_size(), get_tp_rank())
        self.embed_scale = spec.embed_scale
        head_dim = _head_dim(config)
        layer_keys = [spec.rope_key_of(i) for i in range(config.num_hidden_layers)]
        # One rotary table per distinct parameter set (two for Gemma 3), each gathered once per step.
        self.rotaries = nn.ModuleDict(
            {str(key): RotaryEmbedding(config, head_dim, key) for key in dict.fromkeys(layer_keys)}
        )
        self.rotary_keys = list(self.rotaries.keys())
        self.layer_rotary = [self.rotary_keys.index(str(key)) for key in layer_keys]
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, spec, self.rotaries[str(layer_keys[i])], make_mlp(config, i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = spec.norm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        fused = fused_decoder.for_step(self, input_ids)
        if fused is not None:  # the lookup, every layer and the final norm in compiled calls, equal to the below
            return fused(input_ids, positions)
        hidden_states = self.embed_tokens(input_ids)  # [T, hidden]
        if self.embed_scale is not None:  # HF casts the scale to the activations' dtype first
            hidden_states = hidden_states * torch.tensor(self.embed_scale, dtype=hidden_states.dtype)
        residual = None
        # once per step for every layer
        cos_sins = [self.rotaries[key].cos_sin(positions, hidden_states.dtype) for key in self.rotary_keys]
        for layer, rotary in zip(self.layers, self.layer_rotary):
            hidden_states, residual = layer(cos_sins[rotary], hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """The Llama decoder; other Llama-like architectures subclass it and override ``decoder_spec``,
    ``make_mlp`` and, where their checkpoints name or fuse weights differently, ``hf_weights``."""

    # HF name fragment -> (our fused parameter fragment, shard id)
    stacked_params = [
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    ]

    def __init__(self, config):
        super().__init__()
        check_config_tp_size(config, get_tp_size())
        self.config = config
        self.spec = self.decoder_spec(config)
        self.model = LlamaModel(config, self.spec, self.make_mlp)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, get_tp_size(), get_tp_rank())
        self.final_softcap = self.spec.final_softcap
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def decoder_spec(cls, config) -> DecoderSpec:
        return llama_spec(config)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return LlamaMLP(config, self.spec)

    def hf_weights(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """One checkpoint tensor as the Llama-named tensors ``load_weights`` takes (renamed, or a
        fused tensor split); Llama's own are already so."""
        yield name, tensor

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def num_kv_heads(self) -> int:
        """KV heads held (and cached) by this rank."""
        return self.model.layers[0].self_attn.qkv_proj.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.model.layers[0].self_attn.head_dim

    @property
    def sliding_windows(self) -> list[int | None]:
        """Each layer's attention window (None = full attention): what a KV manager may free by."""
        return [layer.self_attn.attn.sliding_window for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        logits = fused_decoder.head_logits(self, hidden_states)  # None: not the fused path's quantized head
        if logits is None:
            logits = self.lm_head.compute_logits(hidden_states)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def greedy_token_ids(self, hidden_states: torch.Tensor) -> torch.Tensor | GreedyFallback:
        """[N, hidden] -> [N] int64, each row's argmax of compute_logits computed without the float32
        logits (layers/greedy_head.py), or why that does not apply (``sampling/sampler.py``'s ``greedy_tokens``
        then takes the argmax of compute_logits)."""
        if self.final_softcap is not None:
            return GreedyFallback.FINAL_SOFTCAP
        head = self.lm_head
        if head.greedy_head is None:  # a quantized, split or batch-invariant head (LMHead.process_weights_after_loading)
            return GreedyFallback.NO_GREEDY_HEAD
        return head.greedy_head.argmax(hidden_states, head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors; returns the names of our parameters that were set."""
        return checkpoint_weights.load_weights(self, weights)

    def process_weights_after_loading(self) -> None:
        """Lay weights out for the fastest GEMM on their device; call once, after the last weight,
        dtype or device change (the loader does). Values and shapes stay as loaded."""
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()

    def expected_weight_keys(self) -> set[str]:
        """The keys ``load_weights`` returns when every parameter was set."""
        return checkpoint_weights.expected_weight_keys(self)
