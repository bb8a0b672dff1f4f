"""Models for pagedllm: Llama-family networks, layers, paged attention, and loaders.

Knows nothing of requests or scheduling: flat token tensors plus ``AttentionMetadata`` in,
hidden states and logits out.
"""

from pagedllm.model.attention.metadata import AttentionMetadata
from pagedllm.model.forward_context import get_forward_context, set_forward_context
from pagedllm.model.loader import LoadedModel, load_model

__all__ = ["AttentionMetadata", "LoadedModel", "get_forward_context", "load_model", "set_forward_context"]
