"""Attention backends: metadata, the CPU PyTorch paged reference, and the ``Attention`` layer."""

from pagedllm.model.attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
