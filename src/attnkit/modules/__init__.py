"""Attention as ``nn.Module``: projections around :func:`attnkit.attention`, and the one
transformer layer that the models are built from."""

from attnkit.modules.attention import CrossAttention, MultiHeadAttention, SelfAttention
from attnkit.modules.transformer import (
    LayerOutput,
    TransformerConfig,
    TransformerLayer,
    TransformerOutput,
    TransformerStack,
)

__all__ = [
    "CrossAttention",
    "LayerOutput",
    "MultiHeadAttention",
    "SelfAttention",
    "TransformerConfig",
    "TransformerLayer",
    "TransformerOutput",
    "TransformerStack",
]
