"""A step's decoder layers in one compiled call (``csrc/decoder_layer.cpp``): the CPU analogue of a
CUDA graph for the Llama family.

At batch 1 on the default model a decode step ran ~10 small ops per layer (norms, the four
linears, rotary, the KV write, attention, SiLU) from Python, 30 layers: the Python frames, module
calls and checks between them cost about as much again as the norms, rotary and activation did.
``decoder_layers_cpu`` runs the same ops, in the same order, on the same inputs, from one C++
loop, so its output equals the per-op path bit for bit (tests/model/test_fused_decoder.py); the
per-op path (``LlamaDecoderLayer.forward``) stays the reference and runs everything else. Around
that call the step's other ops are called directly too, without their modules: the embedding
lookup (``quant_rows_cpu`` for a GGUF table, ``torch.embedding`` for a float32 one), and after it a quantized
LM head's product (``head_logits``: the op and arguments ``QuantizedWeight.matmul`` would pass); the rotary
tables' row gathers (by the step's positions) and the final norm run inside the call. What does not
change between steps (the weights, ints and the model's constants) goes to the op once, as a
``DecoderPlan``.

Covered (checked once, when the model's first step builds the weight lists): CPU float32
activations, tensor-parallel size 1, every linear either float32 panels of the compiled GEMM or a
GGUF-quantized weight of the compiled quantized kernel (or up to three row groups of such weights, a
Q4_K_M file's q/k in Q4_K beside v in Q6_K: layers/quant_groups.py), q/k/v and gate/up biases (o and down
without), LoRA adapter slots (``pagedllm/lora/layers.py``: each linear's deltas for the step's
segments by the op the per-op path calls, ``lora_sgmv_cpu``, so a LoRA step adds the same sums),
plain RMSNorm pre-norm layers (Llama, Mistral and Qwen2 without sliding windows, SmolLM2), SiLU, one
rotary table, full attention without soft-capping, the compiled attention backend, no embedding scale, a float32 or compiled-quantized embedding table, and the batch-invariant mode (its
kernels and attention choices passed along). Per step: at most ``MAX_TOKENS`` tokens (decode rows, prompt chunks
and mixed steps alike: the ops are varlen), a KV cache the compiled attention reads, no hooks on the layers',
the embedding's or the final norm's modules (``bench profile`` times modules with hooks). Not covered, per-op path: Qwen3's and Gemma
3's q/k norms, Gemma's norms and sandwich norms, soft-capping, sliding windows, MoE and other
MLPs (Phi-3's fused names included), MKL- or F.linear-only weights (the compiled GEMM off or
unavailable), tensor parallelism, CUDA, longer steps. ``PAGEDLLM_DISABLE_FUSED_DECODER=1`` turns
it off; ``set_enabled`` switches it in one process (A/B runs, tests).

A model whose layers or weights change after its first step (LoRA adapters, say) must call
``invalidate(model)``: the weight lists are built once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm import envs
from pagedllm.model import batch_invariant
from pagedllm.model.attention.layer import Attention
from pagedllm.model.forward_context import get_forward_context, get_lora_segments
from pagedllm.model.layers import cpu_fused

logger = logging.getLogger(__name__)

MAX_TOKENS = 256
"""Steps of more tokens take the per-op path: there the float32 linears leave the compiled GEMM
(``linear.GEMM_ROWS``) for MKL, which this call does not reach."""

_ATTR = "_fused_decoder"  # on the LlamaModel instance: (attention, backend, a FusedDecoder or None once refused)
_enabled: list[bool] = []  # [] = not decided yet; [flag] = set_enabled's choice, or the environment's at the first step


def set_enabled(enabled: bool | None) -> None:
    """Force the fused call on (where it applies) or off in this process; None = the environment again (read
    at the next step, then kept: a step reads no environment)."""
    _enabled.clear()
    if enabled is not None:
        _enabled.append(enabled)


def enabled() -> bool:
    if not _enabled:
        _enabled.append(not envs.PAGEDLLM_DISABLE_FUSED_DECODER)
    return _enabled[0]


def invalidate(model) -> None:
    """Build the weight lists again at the next step (after a change to ``model``'s layers or weights)."""
    model.__dict__.pop(_ATTR, None)


def for_step(model, input_ids: torch.Tensor) -> FusedDecoder | None:
    """The fused call for this step of ``model`` (a ``LlamaModel``), or None: run the layers one by one."""
    if not (_enabled[0] if _enabled else enabled()):  # inlined: a call per step for a switch read once
        return None
    # (the first layer's attention, the backend it was decided for, the FusedDecoder or None): decided
    # again when the backend changes (a model stepped first under the torch reference, then by the runner).
    decided = model.__dict__.get(_ATTR)
    if decided is None or decided[0].backend is not decided[1]:
        attention = next((m for m in model.layers[0].modules() if isinstance(m, Attention)), None) if len(
            model.layers) else None
        if attention is None:
            return None
        decided = (attention, attention.backend, FusedDecoder.build(model))
        model.__dict__[_ATTR] = decided
    fused = decided[2]
    if fused is None or not fused.applies(input_ids):
        return None
    return fused


def head_logits(causal_lm, hidden_states: torch.Tensor) -> torch.Tensor | None:
    """``causal_lm.lm_head.compute_logits(hidden_states)`` by the head's quantized kernel, called directly, where
    the model's layers take the fused call and the head is a quantized one at one rank outside the batch-invariant
    mode; None elsewhere (the head's own ``compute_logits`` then). The weight is read at each call (a bench may
    give the head another after the first step)."""
    decided = causal_lm.model.__dict__.get(_ATTR)
    if decided is None or decided[2] is None or not (_enabled[0] if _enabled else enabled()):
        return None
    head = causal_lm.lm_head
    weight = head.quant_weight
    if (weight is None or head.tp_size != 1 or head.batch_invariant or hidden_states.dim() != 2
            or hidden_states.dtype != torch.float32 or hidden_states.stride(-1) != 1 or not hidden_states.is_cpu):
        return None
    return decided[2].quant_gemm(hidden_states, weight.packed, weight.kernel_type, weight.n, None, weight.isa)


@dataclass(frozen=True, slots=True)
class DecoderLayerParts:
    """One decoder layer as the compiled call runs it: ``input_layernorm``, ``qkv_proj``, ``attn``, ``o_proj``,
    then ``post_attention_layernorm``, ``gate_up_proj``, ``act``, ``down_proj``, each a residual block. A model's
    layer hands these over (its ``fused_parts()``), or the reason it is not such a layer: this module reads
    nothing else of a layer and imports no model."""

    input_layernorm: nn.Module
    qkv_proj: nn.Module
    attn: nn.Module
    """The ``Attention`` layer (model/attention/layer.py)."""
    o_proj: nn.Module
    post_attention_layernorm: nn.Module
    gate_up_proj: nn.Module
    act: nn.Module
    down_proj: nn.Module
    num_local_heads: int
    """Query heads on this rank."""
    num_local_kv_heads: int
    head_dim: int


class FusedDecoder:
    """The weight lists of one model for ``decoder_layers_cpu``, and the per-step conditions."""

    def __init__(self, model, weights: list[torch.Tensor], linear_info: list[int], norm_lanes: int,
                 silu_block: int, embed: tuple, lora: tuple[list[torch.Tensor], list[int]] | None,
                 first: DecoderLayerParts) -> None:
        layer0 = model.layers[0]
        attn = first  # the shapes and constants every layer shares (checked at build)
        # The batch-invariant mode (model/batch_invariant.py): its linear kernels and attention choices.
        invariant = bool(attn.qkv_proj.batch_invariant and batch_invariant.INVARIANT_KERNELS)
        backend = attn.attn.backend
        num_splits, tile_min_rows = backend.split_args
        lora_weights, lora_info = lora if lora is not None else ([], [])
        # Everything the steps share, handed to the op once (csrc/decoder_layer.cpp checks it there).
        self.plan = torch.classes.pagedllm.DecoderPlan(
            weights, linear_info, lora_weights, lora_info, model.norm._parameters["weight"],
            [attn.num_local_heads, attn.num_local_kv_heads, attn.head_dim, norm_lanes, silu_block, num_splits,
             tile_min_rows, int(invariant)],
            [float(attn.attn.scale), float(attn.input_layernorm.eps), float(model.norm.eps)])
        # Modules whose hooks the fused call would skip: checked each step (a dict's truthiness).
        self._watched = (attn.qkv_proj, attn.attn, layer0, model.embed_tokens, model.norm)
        self._embed = embed  # (quant_rows_cpu, packed, kernel type) or (None, the float32 table's owner, None)
        self._rotary_buffers = model.rotaries[model.rotary_keys[0]]._buffers  # read per step (a .to() replaces them)
        self._checked_caches = None  # the KV cache list last checked (by identity), and whether it is covered
        self._caches_ok = False
        self._op = _direct(torch.ops.pagedllm.decoder_layers_cpu.default)
        self.quant_gemm = _direct(torch.ops.pagedllm.quant_gemm_cpu.default)  # a quantized LM head's (head_logits)
        # LoRA slots: where the step's segments are read (lora/layers.py); the plan holds the slots
        self._lora_segments = None
        if lora is not None:
            self._lora_segments = get_lora_segments

    @classmethod
    def build(cls, model) -> FusedDecoder | None:
        """The fused call for ``model``, or None (logged once, with the reason) where it does not apply."""
        reason = _refusal(model)
        if isinstance(reason, str):
            logger.info("fused decoder layers off for this model (%s); the layers run op by op", reason)
            return None
        return cls(model, *reason)

    def applies(self, input_ids: torch.Tensor) -> bool:
        """Whether this step can take the fused call (the model-wide conditions were checked at build)."""
        if (input_ids.dtype != torch.int64 or not input_ids.is_cpu or input_ids.dim() != 1
                or input_ids.shape[0] > MAX_TOKENS):
            return False
        ctx = get_forward_context()
        if ctx is None or ctx.kv_caches is None or ctx.attn_metadata is None:
            return False
        caches = ctx.kv_caches
        if caches is not self._checked_caches:  # the runner hands the same list every step: check it once
            # the compiled KV write stores into a contiguous CPU cache of these types
            self._caches_ok = all(c.dtype in _KV_DTYPES and c.is_contiguous() and c.is_cpu for c in caches)
            self._checked_caches = caches
        if not self._caches_ok:
            return False
        if (cpu_fused.chosen[0] if cpu_fused.chosen else cpu_fused.ops()) is None:  # switched off (an A/B run)
            return False
        for module in self._watched:
            if module._forward_hooks or module._forward_pre_hooks:
                return False
        return True

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The model's output (after the final norm) for ``input_ids`` at ``positions``, as
        ``LlamaModel.forward``'s per-op path computes it."""
        rows_op, table, kernel_type = self._embed
        if rows_op is not None:  # the GGUF table's rows, as VocabEmbedding's lookup dequantizes them
            hidden_states = rows_op(table, kernel_type, input_ids)
        else:
            hidden_states = torch.embedding(table._parameters["weight"], input_ids)
        buffers = self._rotary_buffers  # RotaryEmbedding.cos_sin's tables: the op gathers the positions' rows
        ctx = get_forward_context()
        md = ctx.attn_metadata
        segments = self._lora_segments() if self._lora_segments is not None else ()  # () = a base-only step
        return self._op(hidden_states, buffers["cos_cache"], buffers["signed_sin_cache"], positions, self.plan,
                        ctx.kv_caches, md.slot_mapping, md.block_tables, md.seq_lens, md.query_start_loc, segments)[0]


def _direct(overload):
    """The C++ callable of an op overload, without OpOverload's Python wrapper."""
    return getattr(overload, "_op", overload)


_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


MAX_ROW_GROUPS = 3
"""A linear's weight as the compiled call takes it: up to 3 row groups of one kernel each (csrc/decoder_layer.cpp)."""


def _linear_entry(linear, bias_allowed: bool) -> tuple[list[torch.Tensor], list[int]] | str:
    """([the row groups' weights, padded to MAX_ROW_GROUPS with empty tensors, then the bias or an empty tensor],
    [number of groups, then kind, n, isa per group, padded]) for one linear, or why it is not covered."""
    from pagedllm.model.layers.linear import LinearBase, RowParallelLinear
    from pagedllm.model.layers.quant_groups import QuantizedRowGroups

    # Exactly the forwards the per-op path runs (a subclass or a wrapper may add to the product).
    if type(linear).forward not in (LinearBase.forward, RowParallelLinear.forward):
        return f"{type(linear).__name__} has its own forward"
    if type(linear).matmul is not LinearBase.matmul:
        return f"{type(linear).__name__} has its own matmul"
    bias = linear._parameters.get("bias")
    if bias is not None and not bias_allowed:
        return "an o_proj or down_proj bias"
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return "a bias that is not contiguous float32"
    if linear.bf16_matmul is not None:
        return "a bf16-matmul weight (a pooling model's)"
    empty = torch.empty(0)
    quant = linear.quant_weight
    if isinstance(quant, QuantizedRowGroups):  # a mixed-type fused weight: each group by its own kernel
        groups = quant.groups
        if len(groups) > MAX_ROW_GROUPS or any(g.packed is None for g in groups):
            return f"a weight in more than {MAX_ROW_GROUPS} row groups"
        entries = [(g.packed, [int(g.kernel_type), int(g.n), int(g.isa)]) for g in groups]
    elif quant is not None:
        if quant.packed is None:
            return "a quantized weight without the compiled kernel's packing"
        entries = [(quant.packed, [int(quant.kernel_type), int(quant.n), int(quant.isa)])]
    elif linear.gemm_weight is not None:
        entries = [(linear.gemm_weight, [-1, int(linear._parameters["weight"].shape[0]), 0])]
    else:
        return "a linear without the compiled GEMM (MKL / F.linear)"
    padding = MAX_ROW_GROUPS - len(entries)
    weights = [w for w, _ in entries] + [empty] * padding + [bias if bias is not None else empty]
    info = [len(entries)] + [i for _, ints in entries for i in ints] + [0, 0, 0] * padding
    return weights, info


def _refusal(model):
    """Why ``model`` (a LlamaModel) is not covered, as a string; else (weights, linear_info, lanes, block,
    embedding entry, LoRA lists or None, the first layer's parts)."""
    from pagedllm.distributed.parallel_state import get_tp_size
    from pagedllm.model.attention import cpu_op
    from pagedllm.model.attention.backend import CpuAttentionBackend
    from pagedllm.model.layers.activation import SiluAndMul
    from pagedllm.model.layers.linear import RowParallelLinear
    from pagedllm.model.layers.norm import RMSNorm

    if not cpu_op.load() or not hasattr(torch.ops.pagedllm, "decoder_layers_cpu"):
        return "the compiled library is unavailable or predates decoder_layers_cpu"
    ops = cpu_fused.ops()
    if ops is None or ops.norm_lanes is None or ops.silu_block is None:
        return "the fused small CPU ops are off or do not round like torch here"
    if get_tp_size() != 1:
        return "tensor parallelism"
    if len(model.layers) == 0 or len(model.rotary_keys) != 1:
        return "rotary parameters per layer type"
    rotary = model.rotaries[model.rotary_keys[0]]
    if any(b.dtype != torch.float32 or not b.is_cpu or not b.is_contiguous()
           for b in (rotary.cos_cache, rotary.signed_sin_cache)):
        return "rotary tables that are not contiguous float32"
    embed = _embedding_entry(model)
    if isinstance(embed, str):
        return embed
    final = model.norm._parameters["weight"]
    if type(model.norm) is not RMSNorm or final.dtype != torch.float32 or not final.is_contiguous() or final.is_cuda:
        return f"a final {type(model.norm).__name__}"
    weights: list[torch.Tensor] = []
    info: list[int] = []
    lora_weights: list[torch.Tensor] = []
    lora_info: list[int] = []
    first = None
    for layer in model.layers:
        parts = layer.fused_parts() if hasattr(layer, "fused_parts") else f"{type(layer).__name__} layers"
        if isinstance(parts, str):
            return parts
        first = first or parts
        attn = mlp = parts
        if type(mlp.act) is not SiluAndMul:
            return f"the {type(mlp.act).__name__} activation"
        a = attn.attn
        if a.sliding_window is not None or a.softcap is not None:
            return "sliding-window or soft-capped attention"
        if not isinstance(a.backend, CpuAttentionBackend) or not a.backend.compiled:
            return f"the {a.backend.name} attention backend"
        if a.backend is not first.attn.backend or a.scale != first.attn.scale:
            return "layers with different attention backends or scales"
        if attn.head_dim not in cpu_op.SUPPORTED_HEAD_DIMS:
            return f"head_dim {attn.head_dim}"
        norms = (parts.input_layernorm, parts.post_attention_layernorm)
        for norm in norms:
            w = norm._parameters["weight"]
            if type(norm) is not RMSNorm or w.dtype != torch.float32 or not w.is_contiguous() or w.is_cuda:
                return f"{type(norm).__name__} norms"
            if norm.eps != first.input_layernorm.eps:
                return "norms with different eps"
        entries = []
        for linear, bias_allowed in ((attn.qkv_proj, True), (attn.o_proj, False), (mlp.gate_up_proj, True),
                                     (mlp.down_proj, False)):
            lora = _lora_entry(linear)
            if isinstance(lora, str):
                return lora
            lora_weights += lora[0]
            lora_info += lora[1]
            if linear.batch_invariant != first.qkv_proj.batch_invariant:
                return "linears in and out of the batch-invariant mode"
            entry = _linear_entry(linear, bias_allowed)
            if isinstance(entry, str):
                return entry
            if isinstance(linear, RowParallelLinear) and linear._parameters.get("bias") is not None:
                return "a row-parallel bias"
            entries.append(entry)
        (qkv_w, qkv_i), (o_w, o_i), (gu_w, gu_i), (d_w, d_i) = entries
        weights += [norms[0]._parameters["weight"], *qkv_w, *o_w, norms[1]._parameters["weight"], *gu_w, *d_w]
        info += qkv_i + o_i + gu_i + d_i
    has_lora = any(lora_info[i] for i in range(0, len(lora_info), 4))
    return (weights, info, ops.norm_lanes, ops.silu_block, embed, (lora_weights, lora_info) if has_lora else None,
            first)


def _lora_entry(linear) -> tuple[list[torch.Tensor], list[int]] | str:
    """([a, b, ranks], [num_parts, part sizes padded to 3]) of one linear's LoRA slots (zeros and empty tensors
    where it has none), or why the compiled op cannot add its deltas."""
    slots = getattr(linear, "lora", None)
    if slots is None:
        empty = torch.empty(0)
        return [empty, empty, empty], [0, 0, 0, 0]
    if not slots.compiled:
        return "LoRA slots the compiled op does not take"
    sizes = slots.part_sizes
    return [slots.a, slots.b, slots.ranks], [len(sizes)] + sizes + [0] * (3 - len(sizes))


def _torch_rows(packed: torch.Tensor, kernel_type: int, ids: torch.Tensor) -> torch.Tensor:
    """quant_rows_cpu's signature over the torch form (bf16 tables)."""
    from pagedllm.model.layers.quant_layout import dequantize_rows_torch

    return dequantize_rows_torch(kernel_type, packed, ids)


def _embedding_entry(model) -> tuple | str:
    """``FusedDecoder._embed`` for ``model.embed_tokens``, or why its lookup is not covered."""
    from pagedllm.model.layers import quant_weight
    from pagedllm.model.layers.embedding import VocabEmbedding

    embed = model.embed_tokens
    if type(embed) is not VocabEmbedding or embed.tp_size != 1 or model.embed_scale is not None:
        return "a scaled, split or subclassed embedding"
    if embed.quant_weight is not None:
        rows_op = quant_weight._rows_op()
        if rows_op is None:
            return "a quantized embedding without the compiled row lookup"
        if embed.quant_weight.kernel_type == quant_weight.BF16_KERNEL:  # the compiled lookup has no bf16 form
            rows_op = _torch_rows
        return rows_op, embed.quant_weight.packed, embed.quant_weight.kernel_type
    weight = embed._parameters["weight"]
    if weight.dtype != torch.float32 or weight.is_cuda:
        return "an embedding table that is not float32 on the CPU"
    return None, embed, None
