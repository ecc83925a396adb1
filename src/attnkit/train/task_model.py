"""The model that ``attnkit train`` trains: embeddings, attnkit's :class:`TransformerStack`, a head.

Dimension legend: B batch, T tokens, V input vocabulary, C output classes, E model width,
N layers, H heads.

Encoder-style (bidirectional): every task scores outputs that depend on tokens anywhere in the
input (the last token for reversal's first output), so no causal mask::

    x (B, T) -> tok_emb(x) + pos_emb[:T]         (B, T, E)   learned absolute positions
             -> TransformerStack (pre-norm)      (B, T, E)
             -> head                             (B, T, C)   logits at every position
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from attnkit.errors import AttentionInputError, shape_str
from attnkit.modules.transformer import TransformerConfig, TransformerStack

__all__ = ["ModelConfig", "ModelOutput", "TaskModel"]


@dataclass(frozen=True)
class ModelConfig:
    """The sizes of a :class:`TaskModel`.

    >>> ModelConfig(vocab_size=16, num_classes=16, max_length=16).layer.ffn_width
    256
    """

    vocab_size: int  # V, input token ids
    num_classes: int  # C, output classes
    max_length: int  # the most tokens T (one learned position each)
    dim: int = 64  # E
    num_layers: int = 2  # N
    num_heads: int = 4  # H

    @property
    def layer(self) -> TransformerConfig:
        """The config of each layer: pre-norm, GELU MLP of width 4E, no dropout, bidirectional."""
        return TransformerConfig(dim=self.dim, num_heads=self.num_heads, norm_first=True)


class ModelOutput(NamedTuple):
    """``logits (B, T, C)``; ``hidden (B, T, E)``, the last hidden state; ``attentions``: each
    layer's weights ``(B, H, T, T)`` when asked, else ``None``."""

    logits: torch.Tensor
    hidden: torch.Tensor
    attentions: tuple[torch.Tensor, ...] | None


class TaskModel(nn.Module):
    """Token embedding + learned positions -> :class:`TransformerStack` -> linear head.

    >>> model = TaskModel(ModelConfig(vocab_size=10, num_classes=10, max_length=8, dim=16))
    >>> out = model(torch.zeros(2, 8, dtype=torch.long), need_weights=True)
    >>> out.logits.shape, len(out.attentions), out.attentions[0].shape
    (torch.Size([2, 8, 10]), 2, torch.Size([2, 4, 8, 8]))
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.pos_emb = nn.Embedding(config.max_length, config.dim)
        self.stack = TransformerStack(config.layer, config.num_layers)
        self.head = nn.Linear(config.dim, config.num_classes)

    def forward(self, x: torch.Tensor, *, need_weights: bool = False) -> ModelOutput:
        if x.dim() != 2 or x.dtype != torch.long or not 1 <= x.shape[1] <= self.config.max_length:
            raise AttentionInputError(
                "attnkit.train.TaskModel",
                "x",
                "`x` must be int64 token ids (B, T) with 1 <= T <= max_length.",
                got=f"{shape_str('x', x, ('B', 'T'))} {x.dtype}",
                expected=f"x (B, T) int64, T <= {self.config.max_length}",
            )
        T = x.shape[1]
        h = self.tok_emb(x) + self.pos_emb.weight[:T]  # (B, T, E)
        out = self.stack(h, need_weights=need_weights)
        hidden = out.last_hidden_state  # (B, T, E), after the final LayerNorm
        return ModelOutput(self.head(hidden), hidden, out.attentions)  # logits (B, T, C)
