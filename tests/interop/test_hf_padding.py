"""A left-padded batch on ``attn_implementation="attnkit"``: during ``generate`` and in one
forward with an ``attention_mask``, the padding reaches attnkit as a mask spec (``causal() &
key_mask(keep)``, the cache's keys included), never as a dense ``L x S`` tensor; every layer of
a forward gets the same spec (its decision is made once, :mod:`attnkit.backends.memo`); and the
tokens and logits are eager's. attnkit's own ``KVCache`` gives a spec for a ragged batch too.

Dimension legend: B batch, T tokens, H query heads, Hkv key/value heads, L query length,
S key length.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import attnkit
import attnkit.interop
from attnkit import KVCache
from attnkit.backends import owned
from attnkit.interop.hf_attention import hf_attention
from attnkit.interop.hf_lazy_mask import spec_of
from attnkit.interop.hf_mask import hf_mask
from attnkit.masks import MaskSpec
from hf_tiny import ATOL_LOGITS, VOCAB, B, T, batch, pair
from oracle import reference_attention, within_naive

transformers = pytest.importorskip("transformers")


def _llama() -> Any:
    """A tiny Llama (GQA: 4 query heads, 2 key/value heads of 8)."""
    return transformers.LlamaConfig(
        vocab_size=VOCAB, pad_token_id=0, hidden_size=32, intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip


@pytest.fixture
def recorded() -> Any:
    """An implementation ``attnkit_rec`` that is attnkit's, recording what its mask function
    returns (with the sizes it was asked for) and what each layer's attention gets."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attnkit.interop.register_hf()
    seen: dict[str, list[Any]] = {"masks": [], "layers": []}

    def mask_fn(*args: Any, **kwargs: Any) -> Any:
        made = hf_mask(*args, **kwargs)
        sizes = (kwargs["q_length"], kwargs["kv_length"], kwargs["q_offset"])
        seen["masks"].append((sizes, spec_of(made)))
        return made

    def attention_fn(module: Any, q: Any, k: Any, v: Any, mask: Any, **kwargs: Any) -> Any:
        seen["layers"].append(spec_of(mask))
        return hf_attention(module, q, k, v, mask, **kwargs)

    ALL_MASK_ATTENTION_FUNCTIONS.register("attnkit_rec", mask_fn)
    ALL_ATTENTION_FUNCTIONS.register("attnkit_rec", attention_fn)
    return seen


def _models(impl: str = "attnkit_rec") -> tuple[Any, Any]:
    ref, ours = pair(_llama())
    ours.set_attn_implementation(impl)
    return ref, ours


def test_generate_with_left_padding_gets_specs_and_eager_tokens(recorded: Any) -> None:
    """Every step's mask is ``causal() & key_mask`` over the prompt and the cache, one object
    for every layer of the forward, owned by attnkit; greedy tokens are eager's."""
    ref, ours = _models()
    ids, mask = batch()
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    want = ref.generate(ids, **copy.deepcopy(kwargs))
    got = ours.generate(ids, **kwargs)
    assert torch.equal(got, want)
    steps = recorded["masks"]
    assert len(steps) == 6  # the prompt, then one per new token after the first
    for n, ((L, S, _q_offset), spec) in enumerate(steps):
        assert isinstance(spec, MaskSpec), f"step {n}: {type(spec).__name__}"
        assert ((T, T) if n == 0 else (1, T + n)) == (L, S)
        assert repr(spec) == f"causal() & key_mask(<bool ({B}, {S})>)"
        assert spec in owned._OWNED
        keep = spec.to_dense(L, S)[:, 0, -1]  # the last query's keys (B, S)
        assert not keep[0, :3].any()
        assert keep[0, 3:].all()
        assert keep[1].all()
    layers = recorded["layers"]
    assert len(layers) == 6 * 3
    for n in range(6):  # the three layers of a forward share its spec
        assert all(m is steps[n][1] for m in layers[3 * n : 3 * n + 3])


def test_one_forward_with_padding_matches_eager(recorded: Any) -> None:
    ref, ours = _models()
    ids, mask = batch()
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()  # padded query rows are garbage on both sides
    torch.testing.assert_close(got[real], want[real], atol=ATOL_LOGITS, rtol=0)
    ((sizes, spec),) = recorded["masks"]
    assert sizes == (T, T, 0)
    assert isinstance(spec, MaskSpec)


def test_explain_of_a_padded_call_names_the_spec() -> None:
    """What a layer runs for a left-padded prefill of 128: the spec, not a dense mask, and auto
    takes blocked, which evaluates it block by block."""
    keep = torch.ones(2, 128, dtype=torch.bool)
    keep[0, :40] = False
    spec = spec_of(hf_mask(
        batch_size=2, q_length=128, kv_length=128, q_offset=0, kv_offset=0,
        attention_mask=keep, config=_llama(),
    ))  # fmt: skip
    assert isinstance(spec, MaskSpec)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 128, 16, generator=g)
    k, v = (torch.randn(2, 2, 128, 16, generator=g) for _ in range(2))
    text = str(attnkit.explain(q, k, v, mask=spec))
    assert "mask: spec causal() & key_mask(<bool (2, 128)>)" in text
    assert "auto takes: blocked" in text
    assert "materialis" not in text.split("passed over:")[0]
    out = attnkit.attention(q, k, v, mask=spec)
    dense = spec.to_dense(128, 128)
    want = reference_attention(q, k, v, mask=dense)[0]
    naive = reference_attention(q, k, v, mask=dense, dtype=q.dtype)[0]
    rows = keep[:, None, :, None].expand_as(out)  # padded query rows see nothing: 0
    within_naive(out, want, naive, where=rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_of_a_ragged_batch_gives_a_spec(dtype: torch.dtype) -> None:
    """Right-padded prompts of 5 and 9 tokens written whole, truncated to their lengths: the
    next token's rule is a spec (each sequence its own keys), and attention over it is the
    oracle's per sequence."""
    g = torch.Generator().manual_seed(0)
    cache = KVCache(2, 2, max_len=16, head_dim=8, dtype=dtype)
    cache.update(0, *(torch.randn(2, 2, 9, 8, generator=g).to(dtype) for _ in range(2)))
    cache.truncate(torch.tensor([5, 9]))
    k_all, v_all = cache.update(
        cache.next_pos(), *(torch.randn(2, 2, 1, 8, generator=g).to(dtype) for _ in range(2))
    )
    rule = cache.rule(1)
    assert isinstance(rule, MaskSpec)
    q = torch.randn(2, 4, 1, 8, generator=g).to(dtype)
    out = attnkit.attention(q, k_all, v_all, mask=rule)
    for b, n in ((0, 6), (1, 10)):  # each sequence alone, over its own keys
        kb, vb = k_all[b : b + 1, :, :n], v_all[b : b + 1, :, :n]
        want = reference_attention(q[b : b + 1], kb, vb, causal=True)[0]
        naive = reference_attention(q[b : b + 1], kb, vb, causal=True, dtype=dtype)[0]
        within_naive(out[b : b + 1], want, naive)
