"""BERT-family encoders (BERT, RoBERTa, XLM-R; e5/bge/gte/MiniLM are these shapes): bidirectional
attention over a sequence's own tokens, absolute position embeddings, token types, post-LayerNorm.

Prefill only, one whole sequence at a time: every token attends to every other, so a sequence is
never split into chunks and no K/V is kept between steps (`uses_kv_cache = False`: the engine backs
its blocks with no tensors). The linears and norms run on the packed tokens (no padding); attention is
torch's scaled_dot_product_attention over groups of sequences of similar length (`AttentionGroups`),
each padded to its longest with the padded keys masked. Module names are Hugging Face's, so a checkpoint
loads by name.

    input_ids, positions, token types  [num_tokens] each, sequences side by side
    seq_lens                           tokens of each sequence, in order
"""

from __future__ import annotations

import functools

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.layers.bf16_matmul import Bf16MatmulLinear

# In place, on a linear's fresh output: a new [tokens, intermediate] tensor a call is large enough to be mapped and
# page-faulted afresh each time (worker/host_memory.py's mmap threshold), which had doubled the activation's time.
_ACTIVATIONS = {"gelu": lambda x: torch.ops.aten.gelu_(x),
                "gelu_new": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
                "relu": lambda x: F.relu(x, inplace=True), "silu": lambda x: F.silu(x, inplace=True)}


class BertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(config.type_vocab_size, 1), config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_types) + self.position_embeddings(positions)
        return self.LayerNorm(x)  # [num_tokens, hidden]


class AttentionGroups:
    """Sequences sorted by length and cut into groups of `GROUP_SIZE`, each gathered into one padded batch.
    One call per sequence is one parallel region over a few small matrices, hundreds per layer, which cost
    more than the padding (docs/embeddings.md, Speed); sorted, a group pads little. Made once per forward,
    used by every layer.

        rows   [seqs * longest] token row of each (sequence, position) read; padding reads row 0
        keep   [seqs, 1, 1, longest] the attention mask: padded keys are never attended to
        back   [seqs * longest] the row each result goes to; padding's go to a spare row
    """

    GROUP_SIZE = 16

    def __init__(self, seq_lens: list[int], device: torch.device) -> None:
        starts = torch.tensor([0, *seq_lens], device=device).cumsum(0)[:-1]
        lens = torch.tensor(seq_lens, device=device)
        order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
        self.groups = []
        for g in range(0, len(order), self.GROUP_SIZE):
            members = torch.tensor(order[g:g + self.GROUP_SIZE], device=device)
            longest = int(lens[members].max())
            positions = torch.arange(longest, device=device)
            valid = positions[None, :] < lens[members, None]  # [seqs, longest]
            token_rows = starts[members, None] + positions[None, :]
            rows = torch.where(valid, token_rows, 0).flatten()  # padding reads row 0 (masked out)
            back = torch.where(valid, token_rows, sum(seq_lens)).flatten()  # padding writes a spare row
            self.groups.append((len(members), longest, rows, valid[:, None, None, :], back))

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """[num_tokens, 3, heads, head_dim] (q, k and v of each token) -> [num_tokens, heads, head_dim], each
        sequence attending to itself only. Per group, one row gather for q, k and v together and one row copy
        back, the padding's rows into a spare row past the tokens (boolean masks and 2-D indices cost ~13% of an
        encoder's time)."""
        num_tokens, _, num_heads, head_dim = qkv.shape
        out = qkv.new_empty(num_tokens + 1, num_heads, head_dim)
        for num_seqs, longest, rows, keep, back in self.groups:
            batch = qkv.index_select(0, rows).view(num_seqs, longest, 3, num_heads, head_dim)
            q, k, v = batch.permute(2, 0, 3, 1, 4).unbind(0)  # [seqs, heads, longest, head_dim] each
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # its memory: [seqs, longest, ...]
            out.index_copy_(0, back, attended.transpose(1, 2).reshape(num_seqs * longest, num_heads, head_dim))
        return out[:num_tokens]


class BertSelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.qkv = None  # (weight, bias) of the three projections as one, once fused (fuse_qkv_weights)
        self.fused_qkv = None  # set by fuse_qkv / fuse_qkv_weights: one product for the three projections

    def fuse_qkv(self, matmul_of) -> None:
        """Multiply x by query, key and value as one [3 * hidden, hidden] weight (``matmul_of(weight)`` builds the
        product, called as ``product(x, bias=bias)``): x is read, and in the bf16 mode rounded, once instead of three
        times. The three linears keep their parameters (checkpoint names) and are no longer called."""
        if self.qkv is None:
            self.fuse_qkv_weights()
        weight, bias = self.qkv
        self.fused_qkv = (matmul_of(weight), bias)

    def fuse_qkv_weights(self) -> None:
        """q, k and v as one ``F.linear`` over a ``[3 * hidden, hidden]`` weight whose thirds the three linears'
        parameters become views of (no copy kept): x read once, one call, q/k/v out in one tensor."""
        projections = (self.query, self.key, self.value)
        weight = torch.cat([p.weight.detach() for p in projections])
        bias = torch.cat([p.bias.detach() for p in projections])
        for p, w, b in zip(projections, weight.chunk(3), bias.chunk(3)):
            p.weight.data, p.bias.data = w, b
        self.qkv = (weight, bias)
        self.fused_qkv = (functools.partial(F.linear, weight=weight), bias)

    def forward(self, x: torch.Tensor, groups: AttentionGroups) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.fused_qkv is not None:
            product, bias = self.fused_qkv
            qkv = product(x, bias=bias).view(num_tokens, 3, self.num_heads, self.head_dim)
        else:
            qkv = torch.stack([proj(x) for proj in (self.query, self.key, self.value)], 1)
            qkv = qkv.view(num_tokens, 3, self.num_heads, self.head_dim)
        return groups.attend(qkv).reshape(num_tokens, -1)  # [num_tokens, hidden]


class BertSelfOutput(nn.Module):
    """dense, then LayerNorm over the residual sum (also the FFN's output block, with other sizes)."""

    def __init__(self, in_size: int, config) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x).add_(residual))  # in place on the fresh output (_ACTIVATIONS)


class BertAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config.hidden_size, config)

    def forward(self, x: torch.Tensor, groups: AttentionGroups) -> torch.Tensor:
        return self.output(self.self(x, groups), x)


class BertIntermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; known: {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[config.hidden_act]
        self.gelu = config.hidden_act == "gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu and isinstance(self.dense, Bf16MatmulLinear):  # the bf16-matmul mode: GELU on the op's tiles
            return self.dense.matmul(x, self.dense.bias, gelu=True)
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, groups: AttentionGroups) -> torch.Tensor:
        attended = self.attention(x, groups)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """The encoder; `forward` returns the last layer's hidden states (what sentence-transformers pools)."""

    uses_kv_cache = False
    has_lm_head = False
    checkpoint_prefixes = ("bert.", "roberta.")
    """Prefixes a task model's checkpoint puts before the encoder's tensors."""

    def __init__(self, config) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {config.position_embedding_type!r} is not supported "
                             f"(absolute is)")
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.position_offset = 0
        """RoBERTa numbers positions from padding_idx + 1."""
        self.num_token_types = max(config.type_vocab_size, 1)

    @property
    def max_sequence_length(self) -> int:
        return self.config.max_position_embeddings - self.position_offset

    def encode(self, input_ids: torch.Tensor, token_types: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """[num_tokens] ids and token types of whole sequences -> [num_tokens, hidden]."""
        positions = torch.cat([torch.arange(n, device=input_ids.device) for n in seq_lens]) + self.position_offset
        x = self.embeddings(input_ids, positions, token_types.clamp(max=self.num_token_types - 1))
        groups = AttentionGroups(seq_lens, input_ids.device)
        for layer in self.encoder.layer:
            x = layer(x, groups)
        return x

    def forward(self, input_ids: torch.Tensor, token_types: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        return self.encode(input_ids, token_types, seq_lens)

    def process_weights_after_loading(self) -> None:
        for layer in self.encoder.layer:
            layer.attention.self.fuse_qkv_weights()

    def hf_name(self, name: str) -> str | None:
        """Our parameter name for a checkpoint tensor; None for one this model does not use."""
        for prefix in self.checkpoint_prefixes:
            name = name.removeprefix(prefix)
        if name.endswith("position_ids") or name.startswith("pooler."):
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for checkpoint_name, tensor in weights:
            name = self.hf_name(checkpoint_name)
            if name is None:
                continue
            if name not in params:
                raise KeyError(f"unexpected weight {checkpoint_name!r}")
            with torch.no_grad():
                params[name].copy_(tensor.materialize() if hasattr(tensor, "materialize") else tensor)
            loaded.add(name)
        return loaded

    def expected_weight_keys(self) -> set[str]:
        return set(dict(self.named_parameters()))


class RobertaModel(BertModel):
    """BERT with positions numbered from padding_idx + 1 and (usually) one token type."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.position_offset = config.pad_token_id + 1


class BertPooler(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)


class BertForSequenceClassification(BertModel):
    """A cross-encoder: the encoder, then tanh(dense(first token)) and a linear classifier."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.pooler = BertPooler(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def hf_name(self, name: str) -> str | None:
        name = name.removeprefix("bert.")
        return None if name.endswith("position_ids") else name

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden] of one sequence -> [num_labels] logits (from its first token)."""
        return self.classifier(torch.tanh(self.pooler.dense(hidden[0])))


class RobertaClassificationHead(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)


class RobertaForSequenceClassification(RobertaModel):
    """A RoBERTa / XLM-R cross-encoder: out_proj(tanh(dense(first token)))."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.classifier = RobertaClassificationHead(config)

    def hf_name(self, name: str) -> str | None:
        name = name.removeprefix("roberta.")
        return None if name.endswith("position_ids") or name.startswith("pooler.") else name

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(hidden[0])))
