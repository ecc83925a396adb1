"""Attention as ``nn.Module``: projections around :func:`attnkit.attention`."""

from attnkit.modules.attention import CrossAttention, MultiHeadAttention, SelfAttention

__all__ = ["CrossAttention", "MultiHeadAttention", "SelfAttention"]
