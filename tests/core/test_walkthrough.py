"""Seed 003's "Life is short, eat dessert first" walk-through, reproduced by attnkit.

Dimension legend: B batch, H heads, L query length, S key length, E embedding width (16),
Dk query/key head dim (24), Dv value head dim (28).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnkit import CrossAttention, MultiHeadAttention
from attnkit.walkthrough import SENTENCE, Walkthrough, life_is_short
from oracle import reference_attention

# printed in seed 003
SEED_WEIGHTS_2 = [0.2912, 0.0106, 0.0982, 0.0625, 0.4917, 0.0458]
SEED_CONTEXT_2 = [-1.5993, 0.0156, 1.2670, 0.0032]
SEED_OMEGA_2 = [8.5808, -7.6597, 3.2558, 1.0395, 11.1466, -0.4800]
SEED_EMBEDDED_0 = [0.3374, -0.1778, -0.3035, -0.5880, 0.3486, 0.6603, -0.2196, -0.3792]


@pytest.fixture(scope="module")
def walk() -> Walkthrough:
    return life_is_short()


@pytest.fixture(scope="module")
def seed_003() -> dict[str, torch.Tensor]:
    """Seed 003's own code, step by step (its variable names)."""
    sentence = "Life is short, eat dessert first"
    dc = {s: i for i, s in enumerate(sorted(sentence.replace(",", "").split()))}
    sentence_int = torch.tensor([dc[s] for s in sentence.replace(",", "").split()])
    torch.manual_seed(123)
    embed = torch.nn.Embedding(6, 16)
    embedded_sentence = embed(sentence_int).detach()

    torch.manual_seed(123)
    d = embedded_sentence.shape[1]
    d_q, d_k, d_v = 24, 24, 28
    W_query = torch.rand(d_q, d)
    W_key = torch.rand(d_k, d)
    W_value = torch.rand(d_v, d)

    x_2 = embedded_sentence[1]
    query_2 = W_query.matmul(x_2)
    keys = W_key.matmul(embedded_sentence.T).T
    values = W_value.matmul(embedded_sentence.T).T
    omega_2 = query_2.matmul(keys.T)
    attention_weights_2 = F.softmax(omega_2 / d_k**0.5, dim=0)
    context_vector_2 = attention_weights_2.matmul(values)
    return {
        "sentence_int": sentence_int,
        "embedded_sentence": embedded_sentence,
        "W_query": W_query,
        "W_key": W_key,
        "W_value": W_value,
        "omega_2": omega_2,
        "attention_weights_2": attention_weights_2,
        "context_vector_2": context_vector_2,
    }


def test_seed_printout_is_what_the_seed_code_gives(seed_003: dict[str, torch.Tensor]) -> None:
    """Guards the recomputation below: it reproduces the seed's printed numbers."""
    assert seed_003["sentence_int"].tolist() == [0, 4, 5, 2, 1, 3]
    torch.testing.assert_close(
        seed_003["embedded_sentence"][0, :8], torch.tensor(SEED_EMBEDDED_0), rtol=0, atol=5e-5
    )
    torch.testing.assert_close(seed_003["omega_2"], torch.tensor(SEED_OMEGA_2), rtol=0, atol=5e-4)
    torch.testing.assert_close(
        seed_003["attention_weights_2"], torch.tensor(SEED_WEIGHTS_2), rtol=0, atol=5e-5
    )


def test_weights_of_the_second_word_match_the_seed(walk: Walkthrough) -> None:
    assert walk.weights.shape == (1, 1, 6, 6)  # (B, H, L, S)
    torch.testing.assert_close(
        walk.weights[0, 0, 1], torch.tensor(SEED_WEIGHTS_2), rtol=0, atol=5e-5
    )
    torch.testing.assert_close(walk.weights.sum(-1), torch.ones(1, 1, 6), rtol=0, atol=1e-6)


def test_context_of_the_second_word_matches_the_seed(walk: Walkthrough) -> None:
    assert walk.context.shape == (1, 1, 6, 28)  # (B, H, L, Dv)
    torch.testing.assert_close(
        walk.context[0, 0, 1, :4], torch.tensor(SEED_CONTEXT_2), rtol=0, atol=5e-4
    )


def test_equals_the_seed_code_recomputed(
    walk: Walkthrough, seed_003: dict[str, torch.Tensor]
) -> None:
    assert walk.tokens == ["Life", "is", "short", "eat", "dessert", "first"]
    assert torch.equal(walk.embedded, seed_003["embedded_sentence"])
    torch.testing.assert_close(
        walk.weights[0, 0, 1], seed_003["attention_weights_2"], rtol=0, atol=1e-6
    )
    torch.testing.assert_close(
        walk.context[0, 0, 1], seed_003["context_vector_2"], rtol=1e-6, atol=1e-6
    )


def test_every_word_equals_the_float64_oracle(
    walk: Walkthrough, seed_003: dict[str, torch.Tensor]
) -> None:
    x = seed_003["embedded_sentence"].double()
    q = (x @ seed_003["W_query"].double().T)[None, None]  # (1, 1, 6, 24)
    k = (x @ seed_003["W_key"].double().T)[None, None]
    v = (x @ seed_003["W_value"].double().T)[None, None]  # (1, 1, 6, 28)
    out, weights = reference_attention(q, k, v)  # scale 1 / sqrt(24), as the seed
    torch.testing.assert_close(walk.weights.double(), weights, rtol=0, atol=1e-6)
    torch.testing.assert_close(walk.context.double(), out, rtol=1e-5, atol=1e-5)


def test_module_context_equals_context(walk: Walkthrough) -> None:
    assert walk.module_context.shape == (1, 6, 28)  # (B, L, Dv)
    torch.testing.assert_close(walk.module_context, walk.context[:, 0], rtol=1e-6, atol=1e-5)


def _by_hand(mod: nn.Module, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """Float64 forward of a module with out_proj Linear or Identity, by hand with the oracle."""
    H, Hkv, Dk, Dv = mod.num_heads, mod.num_kv_heads, mod.head_dim, mod.v_head_dim
    B, L, _ = x.shape
    S = context.shape[1]

    def lin(layer: nn.Module, t: torch.Tensor) -> torch.Tensor:
        b = None if layer.bias is None else layer.bias.double()
        return F.linear(t.double(), layer.weight.double(), b)

    q = lin(mod.q_proj, x).view(B, L, H, Dk).transpose(1, 2)
    k = lin(mod.k_proj, context).view(B, S, Hkv, Dk).transpose(1, 2)
    v = lin(mod.v_proj, context).view(B, S, Hkv, Dv).transpose(1, 2)
    out, _ = reference_attention(q, k, v)
    merged = out.transpose(1, 2).reshape(B, L, H * Dv)
    return lin(mod.out_proj, merged) if isinstance(mod.out_proj, nn.Linear) else merged


def test_three_heads_and_cross_attention(walk: Walkthrough) -> None:
    """The walk-through's later steps, rebuilt with the same seeds, against the oracle."""
    x = walk.embedded[None]  # (1, 6, 16)
    torch.manual_seed(123)
    heads = MultiHeadAttention(16, 3, head_dim=24, v_head_dim=28, bias=False)
    heads.out_proj = nn.Identity()
    assert walk.multihead_context.shape == (1, 6, 3 * 28)
    torch.testing.assert_close(
        walk.multihead_context.double(), _by_hand(heads, x, x), rtol=1e-5, atol=1e-5
    )
    torch.manual_seed(123)
    second_sentence = torch.rand(1, 8, 16)  # (B, S=8, E)
    cross = CrossAttention(16, 2, head_dim=24, v_head_dim=28)
    assert walk.cross_context.shape == (1, 6, 16)
    torch.testing.assert_close(
        walk.cross_context.double(), _by_hand(cross, x, second_sentence), rtol=1e-5, atol=1e-5
    )


def test_lines_report_shapes_and_numbers(walk: Walkthrough) -> None:
    text = "\n".join(walk.lines)
    assert SENTENCE in text
    assert "[0, 4, 5, 2, 1, 3]" in text
    assert "(B, H, L, S)    (1, 1, 6, 6)" in text
    assert "(B, H, L, Dv)   (1, 1, 6, 28)" in text
    assert "[0.2912, 0.0106, 0.0982, 0.0625, 0.4917, 0.0458]" in text
    assert "[-1.5993, 0.0156, 1.2670, 0.0032, ...]" in text
    assert "equal to the above: True" in text
    assert "(1, 6, 84)" in text
    assert "(1, 6, 16)" in text


def test_is_deterministic(walk: Walkthrough) -> None:
    torch.manual_seed(999)
    again = life_is_short()
    assert torch.equal(again.weights, walk.weights)
    assert torch.equal(again.context, walk.context)
    assert torch.equal(again.cross_context, walk.cross_context)
    assert again.lines == walk.lines
