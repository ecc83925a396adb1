"""Masks concatenated over the keys stay lazy: ``torch.cat`` of attnkit's lazy masks along the
keys is a lazy mask carrying ``concat_keys`` of their specs, so T5Gemma 2's decoder (self and
cross attention merged into one call over its own keys and the encoder's) runs attnkit on a
spec, never on an ``L x (S1 + S2)`` mask, and matches eager: logits, attention maps and
``generate``'s tokens. Any other ``torch.cat`` still makes transformers' dense masks.

Dimension legend: B batch, T tokens, L query length, S1 the decoder's keys, S2 the encoder's.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import attnkit.interop
import attnkit.interop.hf_attention as hfa
from attnkit.backends import owned
from attnkit.interop.hf_lazy_mask import LazyMask, spec_of
from attnkit.interop.hf_rules import UNMASKED
from attnkit.masks import MaskSpec
from attnkit.masks.concat import ConcatKeys
from hf_tiny import ATOL_LOGITS, ATOL_WEIGHTS, B, pair, record_masks

transformers = pytest.importorskip("transformers")
mu = pytest.importorskip("transformers.masking_utils")

L, S1, S2 = 5, 7, 6
DECODER_PAD = torch.arange(S1)[None] >= torch.tensor([2, 0])[:, None]  # (B, S1) left padding
ENCODER_PAD = torch.arange(S2)[None] < torch.tensor([6, 4])[:, None]  # (B, S2) right padding


@pytest.fixture(autouse=True)
def _registered() -> None:
    attnkit.interop.register_hf()


def _sdpa(fn: Any, q: int, S: int, q_off: int, pad: Any) -> torch.Tensor:
    out: torch.Tensor = mu.sdpa_mask(
        batch_size=B, q_length=q, kv_length=S, q_offset=q_off, kv_offset=0,
        mask_function=fn, attention_mask=pad, allow_is_causal_skip=False,
    )  # fmt: skip
    return out


def _self_mask(**kwargs: Any) -> torch.Tensor:
    """The decoder's causal mask over its S1 keys (the last L of them are the queries)."""
    return hfa.hf_mask(B, L, S1, S1 - L, 0, mu.causal_mask_function, DECODER_PAD, **kwargs)


def _cross_mask(pad: torch.Tensor | None = ENCODER_PAD, **kwargs: Any) -> torch.Tensor:
    """The cross-attention mask over the encoder's S2 keys (bidirectional, its padding)."""
    return hfa.hf_mask(B, L, S2, 0, 0, mu.bidirectional_mask_function, pad, **kwargs)


def test_a_cat_of_lazy_masks_along_the_keys_is_a_lazy_mask_of_concat_keys() -> None:
    mine, cross = _self_mask(), _cross_mask()
    joined = torch.cat([mine, cross], dim=-1)
    assert isinstance(joined, LazyMask)
    assert not joined.made
    assert not mine.made
    assert not cross.made
    assert (joined.shape, joined.dtype) == ((B, 1, L, S1 + S2), torch.bool)
    spec = spec_of(joined)
    assert isinstance(spec, ConcatKeys)
    assert repr(spec) == (
        f"concat_keys(causal() & key_mask(<bool (2, {S1})>), {S1}, "
        f"key_mask(<bool (2, {S2})>), {S2})"
    )
    assert owned.owned(spec)  # built from attnkit's own copies, as its parts are
    want = torch.cat(
        [
            _sdpa(mu.causal_mask_function, L, S1, S1 - L, DECODER_PAD),
            _sdpa(mu.bidirectional_mask_function, L, S2, 0, ENCODER_PAD),
        ],
        dim=-1,
    )
    assert torch.equal(spec.to_dense(L, S1 + S2).expand(B, 1, L, S1 + S2), want)
    assert torch.equal(joined.dense(), want)  # the model's own torch.cat of the dense masks
    assert not mine.made
    assert not cross.made


def test_three_parts_and_torch_concat_nest_and_unmasked_parts_stay_unmasked() -> None:
    joined = torch.concat([_self_mask(), _cross_mask(), _cross_mask()], dim=3)
    assert isinstance(joined, LazyMask)
    assert repr(spec_of(joined)).startswith("concat_keys(concat_keys(causal() & key_mask(")
    assert joined.shape[-1] == S1 + 2 * S2
    bare = torch.cat([_cross_mask(None), _cross_mask(None)], dim=-1)
    assert isinstance(bare, LazyMask)
    assert spec_of(bare) is UNMASKED


def test_any_other_cat_makes_transformers_dense_masks() -> None:
    """Along another dim, with a dense tensor, with ``out=``, or of masks of two dtypes (a
    float mask for a model that adds float biases): the same values as the dense cat."""
    dense_self = _sdpa(mu.causal_mask_function, L, S1, S1 - L, DECODER_PAD)
    rows = torch.cat([_self_mask(), _self_mask()], dim=2)
    assert type(rows) is torch.Tensor
    assert torch.equal(rows, torch.cat([dense_self, dense_self], dim=2))
    extra = torch.zeros(B, 1, L, 3, dtype=torch.bool)
    mixed = torch.cat([_self_mask(), extra], dim=-1)
    assert type(mixed) is torch.Tensor
    assert torch.equal(mixed, torch.cat([dense_self, extra], dim=-1))
    out = torch.empty(B, 1, L, S1 + S2, dtype=torch.bool)
    torch.cat([_self_mask(), _cross_mask()], dim=-1, out=out)
    assert torch.equal(out[..., :S1], dense_self)
    # DeepSeek-V4's compressor bias joined to eager's float mask: dense, as the model needs
    floating = _self_mask(config=SimpleNamespace(model_type="deepseek_v4"), dtype=torch.float32)
    assert isinstance(floating, LazyMask)
    bias = torch.zeros(B, 1, L, 3).masked_fill(torch.rand(B, 1, L, 3) > 0.5, float("-inf"))
    merged = torch.cat([floating, bias.to(floating.dtype)], dim=-1)
    assert type(merged) is torch.Tensor
    assert torch.equal(merged[..., S1:], bias)
    two_dtypes = torch.cat([floating, _cross_mask()], dim=-1)
    assert type(two_dtypes) is torch.Tensor


# ---------------------------------------------------------------------------------------------
# T5Gemma 2, tiny: its decoder's merged self + cross attention on the concatenated spec


def _t5gemma2() -> Any:
    text = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64,
        "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "image_size": 28, "patch_size": 14}  # fmt: skip
    encoder = {"text_config": text, "vision_config": vision, "mm_tokens_per_image": 4,
               "boi_token_index": 60, "eoi_token_index": 61, "image_token_index": 62}  # fmt: skip
    # untied: with the input embedding as the output one, random weights repeat the last token
    return transformers.T5Gemma2Config(
        encoder=encoder, decoder=text, image_token_index=62, tie_word_embeddings=False
    )


def _pair() -> tuple[Any, Any]:
    return pair(_t5gemma2(), transformers.T5Gemma2ForConditionalGeneration)


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 60, (B, 9), generator=g)
    mask = torch.ones(B, 9, dtype=torch.long)
    mask[0, :3] = 0  # the encoder's first row left-padded
    return {"input_ids": ids, "attention_mask": mask}


def _decoder_specs(seen: list[object]) -> list[MaskSpec]:
    return [m for m in seen if isinstance(m, ConcatKeys)]


def test_t5gemma2_decoder_runs_on_the_concatenated_spec_and_matches_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ref, ours = _pair()
    inputs = _inputs()
    g = torch.Generator().manual_seed(2)
    inputs["decoder_input_ids"] = torch.randint(3, 60, (B, 7), generator=g)
    seen, returned = record_masks(monkeypatch)
    with torch.no_grad():
        want = ref(**inputs, output_attentions=True)
        got = ours(**inputs, output_attentions=True)
    torch.testing.assert_close(got.logits, want.logits, atol=ATOL_LOGITS, rtol=0)
    for name in ("decoder_attentions", "cross_attentions"):
        for a, b in zip(getattr(got, name), getattr(want, name), strict=True):
            torch.testing.assert_close(a, b, atol=ATOL_WEIGHTS, rtol=0)
    assert all(isinstance(m, MaskSpec) for m in seen), [type(m).__name__ for m in seen]
    specs = _decoder_specs(seen)
    assert len(specs) == 2  # one per decoder layer: window, then full
    assert repr(specs[0]).startswith("concat_keys(causal() & sliding_window(4)")
    assert repr(specs[1]).startswith("concat_keys(causal(), 7, ")
    assert repr(specs[1]).endswith("key_mask(<bool (2, 9)>), 9)")  # the encoder's padding
    assert not any(isinstance(m, LazyMask) and m.made for m in returned)  # no dense mask made


def test_t5gemma2_generate_gives_eagers_tokens_on_concatenated_specs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode steps past the window (4): each decoder layer of each step gets concat_keys."""
    ref, ours = _pair()
    kwargs = {**_inputs(), "max_new_tokens": 8, "do_sample": False}
    want = ref.generate(**copy.deepcopy(kwargs))
    seen, returned = record_masks(monkeypatch)
    got = ours.generate(**kwargs)
    assert torch.equal(got, want)
    assert len(set(want[0, 1:].tolist())) > 1  # not one token repeated
    assert len(_decoder_specs(seen)) == 8 * 2
    assert all(isinstance(m, MaskSpec) for m in seen)
    assert not any(isinstance(m, LazyMask) and m.made for m in returned)
