"""Seed 003's from-scratch walk-through of "Life is short, eat dessert first", on attnkit.

The seed computes, for the second word ("is"), queries/keys/values with ``d_q = d_k = 24`` and
``d_v = 28``, then the attention weights ``[0.2912, 0.0106, 0.0982, 0.0625, 0.4917, 0.0458]``
and a 28-dim context vector. Here the same numbers come out of :func:`attnkit.attention` for
all six words at once, then out of a :class:`~attnkit.MultiHeadAttention` with the same
weights, then for three heads and for cross-attention to an 8-token second sentence.

Dimension legend: B batch, H heads, L query length, S key length, E embedding width (16),
Dk query/key head dim (24), Dv value head dim (28).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.functional import attention
from attnkit.modules import CrossAttention, MultiHeadAttention

__all__ = ["SENTENCE", "Walkthrough", "life_is_short"]

SENTENCE = "Life is short, eat dessert first"


@dataclass(frozen=True)
class Walkthrough:
    """Every tensor of the walk-through, and the lines that describe it."""

    tokens: list[str]
    embedded: torch.Tensor  # (6, 16)
    weights: torch.Tensor  # (1, 1, 6, 6)
    context: torch.Tensor  # (1, 1, 6, 28)
    module_context: torch.Tensor  # (1, 6, 28), from MultiHeadAttention with the same weights
    multihead_context: torch.Tensor  # (1, 6, 3 * 28)
    cross_context: torch.Tensor  # (1, 6, 16)
    lines: list[str]


def life_is_short() -> Walkthrough:
    """Run the walk-through with the seed's random seeds; return every tensor and a report.

    The seeds are set inside a forked random state: the caller's random state is untouched.
    """
    with torch.random.fork_rng():
        return _life_is_short()


def _life_is_short() -> Walkthrough:
    lines: list[str] = []

    def say(text: str) -> None:
        lines.append(text)

    words = SENTENCE.replace(",", "").split()
    vocab = {s: i for i, s in enumerate(sorted(words))}
    sentence_int = torch.tensor([vocab[s] for s in words])
    say(f'sentence: "{SENTENCE}" -> token ids {sentence_int.tolist()}')

    torch.manual_seed(123)
    embed = torch.nn.Embedding(6, 16)
    embedded = embed(sentence_int).detach()  # (L=6, E=16)
    say(f"embedded sentence          (L, E)          {tuple(embedded.shape)}")

    torch.manual_seed(123)
    d_q, d_k, d_v = 24, 24, 28
    w_query = torch.rand(d_q, 16)
    w_key = torch.rand(d_k, 16)
    w_value = torch.rand(d_v, 16)
    # (L, E) @ (E, D) -> (L, D), then a batch and a head dim in front: (B=1, H=1, L, D)
    q = (embedded @ w_query.T)[None, None]
    k = (embedded @ w_key.T)[None, None]
    v = (embedded @ w_value.T)[None, None]
    say(f"queries q                  (B, H, L, Dk)   {tuple(q.shape)}")
    say(f"keys k                     (B, Hkv, S, Dk) {tuple(k.shape)}")
    say(f"values v                   (B, Hkv, S, Dv) {tuple(v.shape)}")

    context, weights = attention(q, k, v, return_weights=True)
    assert weights is not None  # return_weights=True always returns them
    say(f"attention weights          (B, H, L, S)    {tuple(weights.shape)}")
    say(f"context vectors            (B, H, L, Dv)   {tuple(context.shape)}")
    second = ", ".join(f"{w:.4f}" for w in weights[0, 0, 1].tolist())
    say(f'weights of the 2nd word "is" over the sentence: [{second}]')
    say(f"its context vector starts [{', '.join(f'{c:.4f}' for c in context[0, 0, 1, :4])}, ...]")

    # The same single head as a module: Linear layers hold the same matrices.
    mha = MultiHeadAttention(
        16, 1, head_dim=d_k, v_head_dim=d_v, bias=False, output_projection=False
    )
    with torch.no_grad():
        mha.q_proj.weight.copy_(w_query)
        mha.k_proj.weight.copy_(w_key)
        mha.v_proj.weight.copy_(w_value)
    module_context = mha(embedded[None]).output.detach()  # (B=1, L=6, Dv=28)
    say(
        f"MultiHeadAttention(16, 1, head_dim=24, v_head_dim=28, output_projection=False) "
        f"output (B, L, Dv) "
        f"{tuple(module_context.shape)}, equal to the above: "
        f"{torch.allclose(module_context, context[:, 0], atol=1e-5)}"
    )

    torch.manual_seed(123)
    heads = MultiHeadAttention(
        16, 3, head_dim=d_k, v_head_dim=d_v, bias=False, output_projection=False
    )
    multihead_context = heads(embedded[None]).output.detach()  # (1, 6, 3 * 28)
    say(f"three heads: context (B, L, H*Dv) {tuple(multihead_context.shape)}")

    torch.manual_seed(123)
    second_sentence = torch.rand(1, 8, 16)  # (B=1, S=8, E=16): another sequence, 8 tokens
    cross = CrossAttention(16, 2, head_dim=d_k, v_head_dim=d_v)
    cross_context = cross(embedded[None], second_sentence).output.detach()  # (1, 6, 16)
    say(
        f"cross-attention: 6 queries over an 8-token sentence -> (B, L, E) "
        f"{tuple(cross_context.shape)}"
    )
    return Walkthrough(
        words,
        embedded,
        weights.detach(),
        context.detach(),
        module_context,
        multihead_context,
        cross_context,
        lines,
    )
