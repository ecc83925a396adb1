"""Inkling 2's per-token attention sinks (``sinks=`` ``(B, H, L, 1)``, one logit per query row
and head from ``sink_proj(hidden_states)``) on ``attn_implementation="attnkit"``: passed to
:func:`attnkit.attention` as ``(B, H, L)``, against eager's formula and tiny random Inkling 2
models (logits, ``output_attentions``, the gradient of ``sink_proj``, greedy generation).

Tolerances: the attention function in float64 to 1e-12; models as tests/hf_tiny.py (logits
``1e-4``, weights ``1e-5``, float32).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import attnkit
import attnkit.interop.hf_attention as hfa
from attnkit import AttentionInputError
from attnkit.interop import register_hf
from attnkit.masks import causal, key_mask
from hf_tiny import ATOL_LOGITS, ATOL_WEIGHTS, Layer, batch, pair, transformers

register_hf()

F64 = torch.float64


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
           allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Inkling 2's eager formula (the sink column joined to the scores, then dropped), with
    K/V repeated for the query heads; ``sinks (B, H, L, 1)``."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~allowed, -math.inf)
    weights = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    return (weights @ v).transpose(1, 2), weights


def _qkv_sinks(B: int = 2, L: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = ((B, 4, L, 8), (B, 2, L, 8), (B, 2, L, 8), (B, 4, L, 1))
    return [torch.randn(*s, generator=g, dtype=F64) * 2 for s in shapes]


@pytest.mark.parametrize("form", ["spec", "bool tensor", "none, causal"])
def test_inklings_sinks_join_every_row_as_eager_joins_them(form: str) -> None:
    q, k, v, sinks = _qkv_sinks()
    B, L = q.shape[0], q.shape[2]
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[0, :3] = False  # left padding: the first rows of sequence 0 see no key
    allowed = keep[:, None, None, :] & torch.ones(L, L, dtype=torch.bool).tril()
    mask: Any = {"spec": causal() & key_mask(keep), "bool tensor": allowed, "none, causal": None}
    if form == "none, causal":
        allowed = torch.ones(L, L, dtype=torch.bool).tril().expand(B, 1, L, L)
    out, weights = hfa.hf_attention(Layer(), q, k, v, mask[form], sinks=sinks,
                                    output_attentions=True)  # fmt: skip
    want, want_weights = _eager(q, k, v, sinks, allowed)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(weights, want_weights, atol=1e-12, rtol=0)
    args = hfa.attention_arguments(Layer(), mask[form], sinks=sinks)
    assert args["sinks"].shape == (B, 4, L)
    without, _ = hfa.hf_attention(Layer(), q, k, v, mask[form])
    assert (without - out).abs().max() > 1e-3  # the sinks matter


def test_sinks_and_s_aux_together_are_refused_by_name() -> None:
    q, k, v, sinks = _qkv_sinks()
    with pytest.raises(AttentionInputError) as info:
        hfa.hf_attention(Layer(), q, k, v, None, sinks=sinks, s_aux=torch.zeros(4, dtype=F64))
    assert info.value.argument == "sinks"
    assert "passes both s_aux= (sinks per head) and sinks= (per token)" in str(info.value)
    assert "got:      s_aux=tensor (4,), sinks=tensor (2, 4, 7, 1) from Layer" in str(info.value)


def test_per_token_sinks_of_another_length_are_refused_by_attention() -> None:
    q, k, v, sinks = _qkv_sinks()
    with pytest.raises(AttentionInputError) as info:
        hfa.hf_attention(Layer(), q, k, v, None, sinks=sinks[:, :, :5])
    assert info.value.argument == "sinks"
    assert "sinks (B=2, H=4, L=5)  q (B=2, H=4, L=7)" in str(info.value)


def _config(text_config: str) -> Any:
    """A tiny Inkling 2 text model (one sliding-window layer, one full layer, 4 experts)."""
    sizes = {
        "vocab_size": 64, "unpadded_vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 8,
        "sliding_window_size": 4, "rel_extent": 16, "moe_intermediate_size": 32,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_layers_per_attn_res_block": 1,
        "layer_types": ["hybrid_sliding", "hybrid"], "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2,
    }  # fmt: skip
    return getattr(transformers, text_config)(**sizes)


def _record_sinks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    real = hfa.attention

    def recording(*args: Any, **kwargs: Any) -> Any:
        if kwargs["sinks"] is not None:
            shapes.append(tuple(kwargs["sinks"].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(hfa, "attention", recording)
    return shapes


@pytest.mark.parametrize("text_config", ["Inkling2TextConfig", "Inkling2LoopTextConfig"])
def test_tiny_inkling2_matches_eager_in_logits_and_attentions(
    text_config: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, ours = pair(_config(text_config))
    ids, mask = batch()
    shapes = _record_sinks(monkeypatch)
    with torch.no_grad():
        want = ref(ids, attention_mask=mask, output_attentions=True)
        got = ours(ids, attention_mask=mask, output_attentions=True)
    assert shapes == [(2, 4, 9)] * 2  # both layers' sinks reached attnkit, per token
    real = mask.bool()  # compare real tokens only (eager's padded rows are its own)
    assert (got.logits - want.logits)[real].abs().max() <= ATOL_LOGITS
    assert len(got.attentions) == len(want.attentions) == 2
    for a, b in zip(got.attentions, want.attentions, strict=True):
        rows = real[:, None, :, None].expand_as(a)
        assert (a - b)[rows].abs().max() <= ATOL_WEIGHTS
    with torch.no_grad():  # without the sinks the model is another one: they matter
        for module in ours.modules():
            if hasattr(module, "sink_proj"):
                module.sink_proj.weight.zero_()
        changed = ours(ids, attention_mask=mask).logits
    assert (changed - want.logits)[real].abs().max() > 1e-2


def test_tiny_inkling2_trains_and_generates_as_eager() -> None:
    """The gradient of every parameter (``sink_proj`` included, through attnkit's sinks
    gradient) and greedy generation (decode steps with one sink per new token)."""
    ref, ours = pair(_config("Inkling2TextConfig"))
    ids, mask = batch()
    grads = []
    for model in (ref, ours):
        model.train()
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    sink_grads = [n for n in grads[0] if "sink_proj" in n]
    assert len(sink_grads) == 2
    assert all(grads[0][n].abs().sum() > 0 for n in sink_grads)
    for name, want in grads[0].items():
        torch.testing.assert_close(grads[1][name], want, atol=1e-5, rtol=1e-4, msg=name)
    tokens = [
        m.eval().generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        for m in (ref, ours)
    ]
    assert tokens[1].tolist() == tokens[0].tolist()


def test_the_attention_function_gives_the_sinks_their_gradient() -> None:
    q, k, v, sinks = (t.requires_grad_() for t in _qkv_sinks())
    out, _ = hfa.hf_attention(Layer(), q, k, v, None, sinks=sinks)
    (grad,) = torch.autograd.grad(out.square().sum(), sinks)
    leaf = sinks.detach().squeeze(-1).requires_grad_()
    ref = attnkit.attention(q, k, v, causal=True, sinks=leaf, backend="math")
    (want,) = torch.autograd.grad(ref.transpose(1, 2).square().sum(), leaf)
    assert grad.shape == sinks.shape
    torch.testing.assert_close(grad.squeeze(-1), want, atol=1e-12, rtol=0)
