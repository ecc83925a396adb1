"""A transformers rule attnkit cannot prove reaches it as a function mask, never as a dense
L x S mask: ``from_function`` wrapping transformers' own mask function, called as ``sdpa_mask``
calls it (absolute positions, head 0, broadcast or vmapped as ``use_vmap`` says, the padding
``&``-ed on as ``key_mask``). Checked on direct mask-interface calls (equal to transformers' own
mask, attention equal to the float64 oracle on it, nothing materialised), on a tiny Gemma 3 with
an image block longer than its window, and on a tiny Qwen3 given a model's own lambda through
``create_causal_mask(and_mask_function=...)`` (logits and left-padded ``generate`` tokens equal
eager's, every mask a spec and no lazy mask made).

Dimension legend: B batch, H heads, L query length, S key length, D head size, T tokens.
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
from typing import Any

import pytest
import torch

import attnkit
import attnkit.interop
import attnkit.interop.hf_attention as hfa
from attnkit.interop.hf_lazy_mask import LazyMask, spec_of
from attnkit.masks import MaskSpec
from attnkit.masks.function import FunctionMask
from hf_tiny import ATOL_LOGITS, VOCAB, B, batch, pair, record_masks, tiny_config
from oracle import reference_attention, within_naive

transformers = pytest.importorskip("transformers")
mu = pytest.importorskip("transformers.masking_utils")

LEFT = torch.tensor([3, 0])
PAD = torch.arange(12)[None] >= LEFT[:, None]  # (B, 12), left padding
GROUPS = torch.tensor([[-1, 0, 0, 0, 0, -1, 1, 1, -1, -1, -1, -1],
                       [-1, -1, 2, 2, 2, 2, 2, -1, -1, -1, -1, -1]])  # fmt: skip
PACKED = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2]] * B)
SHIFTED = torch.tensor([[0, 1, 2, 0, 1, 2, 5, 0, 1, 2, 3, 4]] * B)  # a jump inside a document


def _strided(b: Any, h: Any, q: Any, kv: Any) -> Any:
    """A model's own rule: causal, every third key skipped (not one run per row)."""
    return (kv <= q) & ((q - kv) % 3 != 1)


def _vmap_only(b: Any, h: Any, q: Any, kv: Any) -> Any:
    """A rule that only works on one pair at a time (``torch.stack`` of the raw indices), as
    transformers evaluates custom functions with ``use_vmap=True``."""
    return (kv <= q) & (torch.stack([q, kv]).sum(0) % 4 != 1)


CASES = {
    # name: (mask_function, L, S, q_offset, kv_offset, use_vmap)
    "window shorter than an image block (Gemma 3)": (
        mu.and_masks(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(GROUPS)),
                     mu.sliding_window_overlay(3)), 12, 12, 0, 0, True,
    ),
    "positions that jump inside a document": (
        mu.and_masks(mu.remap_positions_for_packed_sequence(
            mu.sliding_window_causal_mask_function(3), SHIFTED),
            mu.packed_sequence_mask_function(PACKED)), 12, 12, 0, 0, False,
    ),
    "a model's own function": (_strided, 12, 12, 0, 0, False),
    "a model's own function, decode steps at an offset": (_strided, 3, 12, 9, 0, False),
    "a model's own function in a window of keys": (_strided, 4, 8, 8, 4, False),
    "a function that only works vmapped": (_vmap_only, 12, 12, 0, 0, True),
}  # fmt: skip


@pytest.fixture(autouse=True)
def _registered() -> None:
    attnkit.interop.register_hf()


def _sdpa(fn: Any, L: int, S: int, q_off: int, kv_off: int, vmap: bool) -> torch.Tensor:
    out: torch.Tensor = mu.sdpa_mask(
        batch_size=B, q_length=L, kv_length=S, q_offset=q_off, kv_offset=kv_off,
        mask_function=fn, attention_mask=PAD, allow_is_causal_skip=False, use_vmap=vmap,
    )  # fmt: skip
    return out


def _parts(spec: object) -> list[object]:
    """The leaves of a spec's ``&`` / ``|`` tree."""
    kids = [getattr(spec, n) for n in ("a", "b") if isinstance(getattr(spec, n, None), MaskSpec)]
    return [spec] if not kids else [leaf for kid in kids for leaf in _parts(kid)]


@pytest.mark.parametrize("case", list(CASES))
def test_an_unproven_rule_is_a_function_mask_equal_to_transformers_mask(case: str) -> None:
    fn, L, S, q_off, kv_off, vmap = CASES[case]
    made = hfa.hf_mask(B, L, S, q_off, kv_off, mask_function=fn, attention_mask=PAD, use_vmap=vmap)
    spec = spec_of(made)
    assert isinstance(made, LazyMask), case
    assert isinstance(spec, MaskSpec), case
    assert any(isinstance(p, FunctionMask) for p in _parts(spec)), repr(spec)
    want = _sdpa(fn, L, S, q_off, kv_off, vmap)
    assert torch.equal(spec.to_dense(L, S).expand(B, 1, L, S), want)
    q, k, v = (
        torch.randn(B, 4, n, 8, generator=torch.Generator().manual_seed(n)) for n in (L, S, S)
    )
    got = attnkit.attention(q, k, v, mask=spec)
    assert not made.made  # attention ran on the function, never on an L x S mask
    ref, _ = reference_attention(q, k, v, mask=want)
    naive, _ = reference_attention(q, k, v, mask=want, dtype=torch.float32)
    within_naive(got, ref, naive, what=case)
    assert torch.equal(made + False, want)  # materialised: transformers' own mask


def test_a_function_that_gives_no_bool_mask_stays_dense() -> None:
    """A rule whose values are not a bool tensor is not attnkit's to read: transformers' mask."""

    def counts(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (kv <= q).to(torch.float32)

    got = hfa.hf_mask(B, 6, 6, 0, 0, mask_function=counts)
    assert type(got) is torch.Tensor
    want = mu.sdpa_mask(batch_size=B, q_length=6, kv_length=6, mask_function=counts,
                        allow_is_causal_skip=False)  # fmt: skip
    assert torch.equal(got, want)


def test_a_static_cache_offset_stays_dense() -> None:
    """A tensor query offset (a static cache) keeps transformers' dense mask, as documented."""
    got = hfa.hf_mask(B, 2, 12, torch.tensor(10), 0, mask_function=_strided, attention_mask=PAD)
    assert type(got) is torch.Tensor
    assert torch.equal(got, _sdpa(_strided, 2, 12, 10, 0, False))


def _no_dense(seen: list[object], returned: list[object]) -> None:
    """Every layer ran on a spec and no mask the interface returned was made dense."""
    assert seen
    assert all(isinstance(m, MaskSpec) for m in seen if m is not None), seen
    assert returned
    assert all(isinstance(m, LazyMask) and not m.made for m in returned), returned


def _gemma3() -> tuple[Any, Any]:
    text = {
        "vocab_size": VOCAB, "pad_token_id": 0, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "sliding_window": 2, "layer_types": ["sliding_attention", "full_attention"],
    }  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "image_size": 28, "patch_size": 7}  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4,
        image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
    )  # fmt: skip
    return pair(config, transformers.Gemma3ForConditionalGeneration)


def _image_batch(T: int = 16) -> dict[str, torch.Tensor]:
    """Left-padded token ids with one image of 4 tokens per row (longer than the window, 2)."""
    ids, mask = batch(T)
    ids[ids >= VOCAB - 3] = 5
    ids[:, 5:9] = VOCAB - 1
    pixels = torch.randn(B, 3, 28, 28, generator=torch.Generator().manual_seed(2))
    types = (ids == VOCAB - 1).long()
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "pixel_values": pixels,
        "token_type_ids": types,
    }


def test_gemma3_window_over_a_longer_image_block_runs_a_function_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ref, ours = _gemma3()
    inputs = _image_batch()
    with torch.no_grad():
        want = ref(**inputs).logits
        seen, returned = record_masks(monkeypatch)
        got = ours(**inputs).logits
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL_LOGITS, rtol=0)
    _no_dense(seen, returned)
    sliding = next(m for m in seen if m is not None)  # layer 0 slides
    assert any(isinstance(p, FunctionMask) for p in _parts(sliding)), repr(sliding)


def test_gemma3_with_an_image_generates_eager_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    ref, ours = _gemma3()
    kwargs = {**_image_batch(), "max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    want = ref.generate(**copy.deepcopy(kwargs))
    seen, returned = record_masks(monkeypatch)
    got = ours.generate(**kwargs)
    assert torch.equal(got, want)
    _no_dense(seen, returned)


def _with_own_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3's masks built with a model's own lambda, as ``and_mask_function``."""
    module = transformers.models.qwen3.modeling_qwen3
    own = functools.partial(
        mu.create_causal_mask, and_mask_function=lambda b, h, q, kv: (q - kv) % 3 != 1
    )
    monkeypatch.setattr(module, "create_causal_mask", own)


def test_a_lambda_given_to_create_causal_mask_runs_a_function_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _with_own_rule(monkeypatch)
    config = tiny_config("qwen3")
    ref, ours = pair(config)
    ids, mask = batch(12)
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        seen, returned = record_masks(monkeypatch)
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL_LOGITS, rtol=0)
    _no_dense(seen, returned)
    assert all(any(isinstance(p, FunctionMask) for p in _parts(m)) for m in seen), seen

    seen.clear()
    returned.clear()
    kwargs = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    want_tokens = ref.generate(ids, **copy.deepcopy(kwargs))  # eager: not attnkit's interface
    assert torch.equal(ours.generate(ids, **kwargs), want_tokens)
    _no_dense(seen, returned)


def test_a_forward_on_a_static_cache_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward (not generate) on a static cache: its keys are the whole buffer, the queries
    stand at the cache's offset, not at its end. Causal read as ``causal()`` (last query at the
    last key) let them see the buffer's empty slots: logits 1.96 off eager before. The offsets
    that do not line up now give transformers' causal function at those offsets."""
    config = tiny_config("qwen3")
    ref, ours = pair(config)
    ids, mask = batch(9)
    logits = []
    for model in (ref, ours):
        cache = transformers.StaticCache(config=config, max_cache_len=16)
        if model is ours:
            seen, returned = record_masks(monkeypatch)
        with torch.no_grad():
            logits.append(model(ids, attention_mask=mask, cache=cache).logits)
    real = mask.bool()
    torch.testing.assert_close(logits[1][real], logits[0][real], atol=ATOL_LOGITS, rtol=0)
    _no_dense(seen, returned)
    assert all("from_function(transformers[causal_mask_function])" in repr(m) for m in seen)


def test_the_mask_interface_imports_no_dynamo() -> None:
    """The vmapped form needs torch._dynamo (which imports sympy, seconds): only when it runs."""
    code = (
        "import sys, attnkit.interop.hf_mask, attnkit.interop.hf_function; "
        "print(sorted(m for m in ('sympy', 'torch._dynamo') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
