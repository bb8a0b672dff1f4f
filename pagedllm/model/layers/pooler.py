"""The sentence-embedding head: hidden states of one sequence -> its vector, as sentence-transformers
computes it (Pooling, then each Dense, then Normalize; config/embedder.py reads which).

It sees one sequence's final hidden states (after the model's final norm), never a request: the
runner hands it each finished prompt's rows.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.config.embedder import DenseLayer, EmbedderConfig

_ACTIVATIONS = {"identity": nn.Identity, "tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU,
                "sigmoid": nn.Sigmoid, "silu": nn.SiLU}


def pool_tokens(mode: str, hidden: torch.Tensor) -> torch.Tensor:
    """[num_tokens, hidden] -> [hidden] by one of config/embedder.py POOLING_MODES."""
    if mode == "cls":
        return hidden[0]
    if mode == "lasttoken":
        return hidden[-1]
    if mode == "max":
        return hidden.max(dim=0).values
    if mode == "mean":
        return hidden.sum(dim=0) / hidden.shape[0]
    if mode == "mean_sqrt_len_tokens":
        return hidden.sum(dim=0) / hidden.new_tensor(float(hidden.shape[0])).sqrt()
    if mode == "weightedmean":  # position i (from 1) weighs i
        weights = torch.arange(1, hidden.shape[0] + 1, dtype=hidden.dtype, device=hidden.device)
        return (hidden * weights[:, None]).sum(dim=0) / weights.sum()
    raise ValueError(f"unknown pooling mode {mode!r}")


class Pooler(nn.Module):
    """Pooling -> Dense* -> Normalize, with the Dense weights loaded from their module directories."""

    def __init__(self, config: EmbedderConfig, hidden_size: int) -> None:
        super().__init__()
        self.config = config
        size = hidden_size * len(config.pooling_modes)
        layers = []
        for dense in config.dense:
            if dense.in_features != size:
                raise ModelLoadError(f"{dense.path}: in_features {dense.in_features} does not match the "
                                     f"{size} values reaching it")
            layers.append(_load_dense(dense))
            size = dense.out_features
        self.dense = nn.ModuleList(layers)
        self.embedding_size = size
        """Values in the vector this head returns (before a request's `dimensions`)."""

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, dimensions: int | None = None) -> torch.Tensor:
        """[num_tokens, hidden] of one whole sequence -> its float32 [embedding_size] (or [dimensions])."""
        hidden = hidden.float()
        vector = torch.cat([pool_tokens(mode, hidden) for mode in self.config.pooling_modes])
        for layer in self.dense:
            vector = layer(vector)
        if self.config.normalize:
            vector = F.normalize(vector, p=2, dim=-1)
        if dimensions is not None:  # Matryoshka: the leading values carry the meaning; renormalized like the whole
            vector = vector[:dimensions]
            if self.config.normalize:
                vector = F.normalize(vector, p=2, dim=-1)
        return vector


class ScoreHead(nn.Module):
    """A cross-encoder's score: the model's classifier over a pair's hidden states, then the activation
    sentence-transformers applies (config/embedder.py `score_activation`)."""

    def __init__(self, model: nn.Module, config: EmbedderConfig) -> None:
        super().__init__()
        self.classify = model.classify
        self.activation = _ACTIVATIONS[config.score_activation]()
        self.embedding_size = 1

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, dimensions: int | None = None) -> torch.Tensor:
        """[num_tokens, hidden] of one pair -> float32 [1]: its score."""
        return self.activation(self.classify(hidden).float())


def _load_dense(dense: DenseLayer) -> nn.Module:
    path = Path(dense.path)
    if (path / "model.safetensors").exists():
        from safetensors.torch import load_file

        state = load_file(str(path / "model.safetensors"))
    elif (path / "pytorch_model.bin").exists():
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ModelLoadError(f"{path} has neither model.safetensors nor pytorch_model.bin")
    linear = nn.Linear(dense.in_features, dense.out_features, bias=dense.bias)
    try:
        linear.load_state_dict({k.removeprefix("linear."): v.float() for k, v in state.items()})
    except RuntimeError as e:
        raise ModelLoadError(f"{path}: the Dense weights do not match its config.json: {e}") from e
    return nn.Sequential(linear, _ACTIVATIONS[dense.activation]()).eval()
