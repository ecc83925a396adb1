"""A relative position bias passed as ``position_bias=`` (T5 and its family, Inkling) runs on
``attn_implementation="attnkit"``: added to the scores as eager adds it, inside the mask's spec
(``spec & DenseMask(bias)``), with its gradient where it trains."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import attnkit
import attnkit.interop.hf_attention as hfa
from attnkit import AttentionInputError
from attnkit.interop import register_hf
from attnkit.masks import DenseMask, MaskSpec, causal, key_mask
from hf_tiny import ATOL_LOGITS, transformers


class Layer(torch.nn.Module):
    is_causal = False


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
           allowed: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """T5's eager formula in float64 (no scaling: T5 passes scaling=1.0 here too)."""
    scores = (q @ k.transpose(-1, -2) + bias).masked_fill(~allowed, -math.inf)
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)


@pytest.mark.parametrize("form", ["spec", "bool tensor", "float tensor", "none, causal"])
def test_the_bias_is_added_to_the_scores_under_every_form_of_mask(form: str) -> None:
    g = torch.Generator().manual_seed(0)
    B, H, L, D = 2, 4, 7, 8
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, H, L, L, generator=g, dtype=torch.float64)
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[0, 2:4] = False
    allowed = keep[:, None, None, :] & torch.ones(L, L, dtype=torch.bool).tril()
    mask: Any = {
        "spec": causal() & key_mask(keep),
        "bool tensor": allowed,
        "float tensor": torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(
            ~allowed, torch.finfo(torch.float64).min
        ),
        "none, causal": None,
    }[form]
    if form == "none, causal":
        allowed = torch.ones(L, L, dtype=torch.bool).tril().expand(B, 1, L, L)
    layer = Layer()
    layer.is_causal = form == "none, causal"
    out, _ = hfa.hf_attention(layer, q, k, v, mask, scaling=1.0, position_bias=bias)
    torch.testing.assert_close(out, _eager(q, k, v, bias, allowed), atol=1e-12, rtol=0)
    args = hfa.attention_arguments(layer, mask, scaling=1.0, position_bias=bias)
    if form in ("spec", "none, causal"):  # the rule stays a spec: blocks it empties are skipped
        assert isinstance(args["mask"], MaskSpec)
        assert "dense float mask (1, 4, 7, 7)" in str(args["mask"])
    without, _ = hfa.hf_attention(layer, q, k, v, mask, scaling=1.0)
    assert (without - out).abs().max() > 1e-3  # the bias matters


def test_the_blocked_backend_serves_the_spec_with_the_bias_outside_training() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 300, 16, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, 2, 300, 300, generator=g, dtype=torch.float64)
    args = hfa.attention_arguments(Layer(), causal(), scaling=1.0, position_bias=bias)
    assert attnkit.explain(q, k, v, mask=args["mask"], backend="blocked").chosen == "blocked"
    out = attnkit.attention(q, k, v, mask=args["mask"], scale=1.0, backend="blocked")
    allowed = torch.ones(300, 300, dtype=torch.bool).tril()
    expected = _eager(q, k, v, bias, allowed).transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (torch.zeros(1, 4, 7, 7, dtype=torch.bool), "position_bias=Tensor (1, 4, 7, 7) torch.bool"),
        (0.5, "position_bias=float"),
    ],
)
def test_a_bias_that_is_not_a_float_tensor_is_refused_by_name(value: object, shown: str) -> None:
    q = torch.randn(1, 4, 7, 8)
    with pytest.raises(AttentionInputError) as info:
        hfa.hf_attention(Layer(), q, q, q, None, position_bias=value)
    message = str(info.value)
    assert "hf_attention (Layer): position_bias must be a float tensor (B|1, H, L, S)" in message
    assert f"got:      {shown}" in message
    assert info.value.argument == "position_bias"


def test_a_bias_of_the_wrong_shape_is_refused_by_attention() -> None:
    q = torch.randn(1, 4, 7, 8)
    with pytest.raises(AttentionInputError, match="mask"):
        hfa.hf_attention(Layer(), q, q, q, None, position_bias=torch.zeros(1, 4, 5, 7))


def _t5() -> tuple[Any, dict[str, torch.Tensor]]:
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0,
        pad_token_id=0, dropout_rate=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config)
    for p in model.parameters():  # large weights, so that attention (and the bias) matters
        p.data.normal_(0, 0.3)
    return config, model.state_dict()


def _load(config: Any, state: dict[str, torch.Tensor], impl: str) -> Any:
    model = transformers.T5ForConditionalGeneration._from_config(config, attn_implementation=impl)
    model.load_state_dict(state)
    return model


def test_t5_matches_eager_in_logits_generation_and_the_bias_gradient() -> None:
    register_hf()
    config, state = _t5()
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, -3:] = 0  # T5 pads on the right
    labels = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    results = {}
    for impl in ("eager", "attnkit"):
        model = _load(config, state, impl).train()
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        tokens = model.eval().generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False
        )
        results[impl] = (out.logits.detach(), grads, tokens)
    (logits, grads, tokens), (ref_logits, ref_grads, ref_tokens) = (
        results["attnkit"],
        results["eager"],
    )
    assert (logits - ref_logits).abs().max() <= ATOL_LOGITS
    assert tokens.tolist() == ref_tokens.tolist()
    assert grads.keys() == ref_grads.keys()
    biases = [n for n in grads if "relative_attention_bias" in n]
    assert len(biases) == 2  # the encoder's and the decoder's
    for name in biases:
        assert ref_grads[name].abs().sum() > 0
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_t5_layers_get_a_spec_holding_the_bias(monkeypatch: pytest.MonkeyPatch) -> None:
    register_hf()
    config, state = _t5()
    seen: list[object] = []
    real = hfa.attention

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["mask"])
        return real(*args, **kwargs)

    monkeypatch.setattr(hfa, "attention", recording)
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _load(config, state, "attnkit").eval()(input_ids=ids, decoder_input_ids=ids[:, :4])
    assert len(seen) == 6  # 2 encoder self, 2 decoder self, 2 cross
    self_attention = [m for m in seen if isinstance(m, MaskSpec) and "dense float" in str(m)]
    assert len(self_attention) >= 4
    assert any(isinstance(m, MaskSpec) and "causal()" in str(m) for m in self_attention)
    assert all(not isinstance(m, DenseMask) or m.has_bias for m in seen)
