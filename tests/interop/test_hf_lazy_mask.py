"""transformers' masks as attnkit specs for any model, through the lazy mask: models of types
no list names (Qwen3 with window layers, Gemma 3 text with window and full layers, GPT-2,
Llama 4 text with chunks, Phi-3) get a spec in every layer and match eager with left padding;
a model that operates on its mask gets transformers' exact dense mask; every rule
transformers composes reads as a spec equal to transformers' own dense mask, and what cannot
be proven is transformers' own function as a function mask.

Dimension legend: B batch, T tokens, L query length, S key length.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import attnkit.interop
import attnkit.interop.hf_attention as hfa
from attnkit.interop.hf_lazy_mask import LazyMask, spec_of
from attnkit.masks import MaskSpec
from hf_tiny import ATOL_LOGITS, VOCAB, B, batch, pair, record_masks

transformers = pytest.importorskip("transformers")
mu = pytest.importorskip("transformers.masking_utils")

T = 12
SMALL = {"vocab_size": VOCAB, "pad_token_id": 0}
LLAMA_LIKE = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip

CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(
        **SMALL, **LLAMA_LIKE, head_dim=8, use_sliding_window=True, sliding_window=4,
        max_window_layers=1,
    ),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **SMALL, **LLAMA_LIKE, head_dim=8, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "gpt2": lambda: transformers.GPT2Config(
        **SMALL, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=None,
        eos_token_id=None,
    ),
    "llama4_text": lambda: transformers.Llama4TextConfig(
        **SMALL, **LLAMA_LIKE, head_dim=8, attention_chunk_size=4, intermediate_size_mlp=64,
        num_local_experts=2, interleave_moe_layer_step=1, no_rope_layers=[1, 0],
    ),
    "phi3": lambda: transformers.Phi3Config(**SMALL, **LLAMA_LIKE, sliding_window=4),
}  # fmt: skip

#: what each layer's rule must contain (left-padded batch)
RULES = {
    "qwen3": ["causal() & key_mask", "causal() & sliding_window(4) & key_mask"],
    "gemma3_text": ["causal() & sliding_window(4) & key_mask", "causal() & key_mask"],
    "gpt2": ["causal() & key_mask"] * 2,
    "llama4_text": ["causal() & document(<ids (2, 12)>) & key_mask", "causal() & key_mask"],
    "phi3": ["causal() & sliding_window(4) & key_mask"] * 2,
}


@pytest.fixture(autouse=True)
def _registered() -> None:
    attnkit.interop.register_hf()


def _record(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The masks attnkit.attention gets from hf_attention (direct runs included)."""
    return record_masks(monkeypatch)[0]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_any_model_gets_specs_and_matches_eager(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ref, ours = pair(CONFIGS[name]())
    ids, mask = batch(T)
    seen = _record(monkeypatch)
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL_LOGITS, rtol=0)
    assert all(isinstance(m, MaskSpec) for m in seen), [type(m).__name__ for m in seen]
    assert [repr(m).split("(<bool")[0] for m in seen] == RULES[name]


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text", "llama4_text"])
def test_generate_with_left_padding_gets_specs_and_eager_tokens(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, ours = pair(CONFIGS[name]())
    ids, mask = batch(T)
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    want = ref.generate(ids, **copy.deepcopy(kwargs))
    seen = _record(monkeypatch)
    got = ours.generate(ids, **kwargs)
    assert torch.equal(got, want)
    assert len(seen) == 6 * 2
    assert all(isinstance(m, MaskSpec) for m in seen)


def test_a_model_that_edits_its_mask_gets_transformers_dense_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An attention path that slices the mask (as a model's code may) works on the dense mask
    transformers' sdpa path would get, made from the lazy one, and still matches eager."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    made: list[torch.Tensor] = []

    def editing(module: Any, q: Any, k: Any, v: Any, mask: Any, **kwargs: Any) -> Any:
        assert isinstance(mask, LazyMask)
        assert not mask.made  # shape, dtype, ndim and device need no values
        assert (mask.shape, mask.dtype, mask.ndim) == ((B, 1, T, T), torch.bool, 4)
        edited = mask[:, :, :, : k.shape[-2]]  # any torch operation: the dense mask
        assert type(edited) is torch.Tensor
        made.append(edited)
        return hfa.hf_attention(module, q, k, v, edited, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register("attnkit_edit", editing)
    mu.ALL_MASK_ATTENTION_FUNCTIONS.register("attnkit_edit", hfa.hf_mask)
    ref, ours = pair(CONFIGS["qwen3"]())
    ours.set_attn_implementation("attnkit_edit")
    ids, mask = batch(T)
    seen = _record(monkeypatch)
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL_LOGITS, rtol=0)
    window = mu.sliding_window_causal_mask_function(4)
    for edited, fn in zip(made, [mu.causal_mask_function, window], strict=True):
        assert torch.equal(edited, _sdpa(fn, T, T, 0, 0, mask.bool()))
    assert all(type(m) is torch.Tensor for m in seen)


def test_a_write_into_the_mask_is_what_attention_gets() -> None:
    pad = PAD[:, :5]
    made = hfa.hf_mask(B, 5, 5, attention_mask=pad, config=transformers.GPT2Config())
    assert isinstance(spec_of(made), MaskSpec)
    made[:, :, :, 4] = False  # in place: the dense mask, then the write
    got = spec_of(made)
    assert isinstance(got, torch.Tensor)
    want = _sdpa(mu.causal_mask_function, 5, 5, 0, 0, pad).clone()
    want[:, :, :, 4] = False
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# the rules, one by one: spec == transformers' dense mask


def _sdpa(fn: Any, L: int, S: int, q_off: Any, kv_off: int, pad: Any) -> torch.Tensor:
    out: torch.Tensor = mu.sdpa_mask(
        batch_size=B, q_length=L, kv_length=S, q_offset=q_off, kv_offset=kv_off,
        mask_function=fn, attention_mask=pad, allow_is_causal_skip=False,
    )  # fmt: skip
    return out


LEFT = torch.tensor([3, 0])
PAD = torch.arange(10)[None] >= LEFT[:, None]  # (B, 10), left padding
GROUPS = torch.tensor([[-1, 0, 0, 0, -1, -1, 1, 1, -1, -1], [-1, -1, 2, 2, 2, 2, -1, -1, -1, -1]])
PACKED = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]] * B)
POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2]] * B)
WINDOWED = mu.sliding_window_causal_mask_function(3)

RULE_CASES = {
    # name: (mask_function, L, S, q_offset, kv_offset, 2-D mask)
    "chunks, left padding": (mu.chunked_causal_mask_function(3, LEFT), 10, 10, 0, 0, PAD),
    "chunks, decode step": (mu.chunked_causal_mask_function(3, LEFT), 1, 10, 9, 0, PAD),
    "image blocks (or_masks)": (
        mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(GROUPS)), 10, 10, 0, 0, PAD
    ),
    "window or image blocks": (mu.or_masks(WINDOWED, mu.blockwise_overlay(GROUPS)), 8, 10, 2, 0,
                               None),
    "packed sequences, window": (
        mu.and_masks(mu.remap_positions_for_packed_sequence(WINDOWED, POSITIONS),
                     mu.packed_sequence_mask_function(PACKED)), 10, 10, 0, 0, None,
    ),
    "window over image blocks (Gemma 3)": (
        mu.and_masks(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(GROUPS)),
                     mu.sliding_window_overlay(4)), 10, 10, 0, 0, PAD,
    ),
    "bidirectional window, padded": (
        mu.sliding_window_bidirectional_mask_function(2), 10, 10, 0, 0, PAD
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(RULE_CASES))
def test_every_composed_rule_is_a_spec_equal_to_transformers_mask(case: str) -> None:
    fn, L, S, q_off, kv_off, pad = RULE_CASES[case]
    made = hfa.hf_mask(B, L, S, q_off, kv_off, mask_function=fn, attention_mask=pad)
    spec = spec_of(made)
    assert isinstance(spec, MaskSpec), case
    assert torch.equal(spec.to_dense(L, S).expand(B, 1, L, S), _sdpa(fn, L, S, q_off, kv_off, pad))
    assert torch.equal(made + False, _sdpa(fn, L, S, q_off, kv_off, pad))  # materialised


SHIFTED = torch.tensor([[0, 1, 2, 0, 1, 2, 5, 0, 1, 2]] * B)  # a jump inside a document
UNPROVEN_CASES = {
    # a one-sided window over image blocks longer than it (one of 4 positions, window 3)
    "window shorter than an image block": mu.and_masks(
        mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(GROUPS)),
        mu.sliding_window_overlay(3),
    ),
    "positions that jump inside a document": mu.and_masks(
        mu.remap_positions_for_packed_sequence(WINDOWED, SHIFTED),
        mu.packed_sequence_mask_function(PACKED),
    ),
    "chunks at remapped positions": mu.and_masks(
        mu.remap_positions_for_packed_sequence(mu.chunked_causal_mask_function(3, LEFT),
                                               POSITIONS),
        mu.packed_sequence_mask_function(PACKED),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(UNPROVEN_CASES))
def test_what_cannot_be_proven_is_a_function_mask(case: str) -> None:
    """transformers' own function as ``from_function`` (more in test_hf_function_mask.py)."""
    fn = UNPROVEN_CASES[case]
    got = hfa.hf_mask(B, 10, 10, 0, 0, mask_function=fn)
    spec = spec_of(got)
    assert isinstance(got, LazyMask)
    assert "from_function(transformers[" in repr(spec)
    assert torch.equal(spec.to_dense(10, 10).expand(B, 1, 10, 10), _sdpa(fn, 10, 10, 0, 0, None))
    assert not got.made


def test_masks_a_model_builds_in_its_forward_are_lazy_generates_ahead_are_dense() -> None:
    """Gemma 3's multimodal forward builds its masks with create_masks_for_generate: lazy;
    generate building a static cache's masks ahead (through a model's method of that name,
    from prepare_inputs_for_generation) gets plain tensors."""
    config = CONFIGS["qwen3"]()
    config._attn_implementation = "attnkit"
    args = {"config": config, "inputs_embeds": torch.zeros(B, T, 32), "cache": None}
    args["attention_mask"] = batch(T)[1]

    def forward() -> Any:
        return mu.create_masks_for_generate(**args)

    def create_masks_for_generate() -> Any:
        return mu.create_masks_for_generate(**args)

    def prepare_inputs_for_generation() -> Any:
        return create_masks_for_generate()

    made = forward()
    assert all(isinstance(m, LazyMask) for m in made.values())
    ahead = prepare_inputs_for_generation()
    assert all(type(m) is torch.Tensor for m in ahead.values())
    for kind, mask in made.items():
        assert torch.equal(mask.dense(), ahead[kind])
