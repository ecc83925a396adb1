"""What attnkit does with each keyword argument transformers' attention layers pass.

Every name a model in the installed transformers writes into its ``attention_interface(...)``
call is classified (computed, harmless, refused); a refused feature is refused by name with
the fix, an unknown one too; harmless ones leave the output unchanged. DeepSeek-V3.2's sparse
top-k selection is refused (a tiny random model; attnkit computed dense attention before).
Packed documents from ``cu_seq_lens_q`` / ``cu_seq_lens_k`` against ``eager`` on each document.

Tolerances: logits ``atol=1e-4``; attention weights ``atol=1e-5`` (float32).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

import attnkit
import attnkit.interop.hf_attention as hfa
from attnkit import AttentionInputError
from attnkit.interop import register_hf
from attnkit.interop.hf_kwargs import KWARGS, markdown_table
from hf_tiny import ATOL_LOGITS, EAGER_FIX, Layer, T, batch, pair, tiny_config, transformers

register_hf()

DOCS = (Path(__file__).resolve().parents[2] / "docs" / "hf.md").read_text()


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 8, generator=g)
    k, v = torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    return q, k, v


# ---------------------------------------------------------------------------------------------
# the survey: every name a model writes into its attention call is classified


def _written_names() -> dict[str, set[str]]:
    """Keyword names in every ``attention_interface(...)`` call of the installed models."""
    root = Path(inspect.getfile(transformers)).parent / "models"
    names: dict[str, set[str]] = {}
    for path in sorted(root.glob("*/modeling_*.py")):
        source = path.read_text()
        if "attention_interface(" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if called != "attention_interface":
                continue
            for keyword in node.keywords:
                if keyword.arg is not None:
                    names.setdefault(keyword.arg, set()).add(path.parent.name)
    return names


def test_every_keyword_a_model_writes_into_its_attention_call_is_classified() -> None:
    names = _written_names()
    assert len(names) > 10  # the survey found the calls (transformers 5.24: 21 names)
    assert {"dropout", "scaling", "indices", "block_indices", "s_aux"} <= set(names)
    positional = {"attention_mask", "query", "key", "value"}  # hf_attention's own parameters
    missing = {
        n: sorted(m)[:3] for n, m in names.items() if n not in KWARGS and n not in positional
    }
    assert missing == {}
    assert set(inspect.signature(hfa.hf_attention).parameters) >= positional
    assert KWARGS["indices"].kind == "computed"  # masks.selected_keys (tests/interop/test_hf_dsa)
    assert KWARGS["block_indices"].kind == "refused"
    assert KWARGS["sinks"].kind == "computed"  # Inkling 2's per token (tests/interop/test_hf_sinks)
    assert {"deepseek_v32", "glm_moe_dsa", "mistral_large4"} <= names["indices"]


# ---------------------------------------------------------------------------------------------
# the attention function on its own: refused, unknown, harmless


REFUSED = {
    # kwarg: (value a model passes, the feature the message names)
    "block_indices": (
        torch.zeros(1, 2, 6, 1, dtype=torch.long),
        "MiniMax-M3's block-sparse key selection (block_indices=...)",
    ),
    "head_mask": (torch.ones(4), "a head mask (head_mask)"),
}


@pytest.mark.parametrize("kwarg", list(REFUSED))
def test_a_feature_attnkit_does_not_compute_is_refused_by_name(kwarg: str) -> None:
    value, feature = REFUSED[kwarg]
    q, k, v = _qkv()
    with pytest.raises(AttentionInputError, match=r"hf_attention \(Layer\)") as info:
        hfa.hf_attention(Layer(), q, k, v, None, **{kwarg: value})
    message = str(info.value)
    assert f"this model uses {feature}" in message
    assert "which attnkit does not compute yet" in message
    assert f"got:      {kwarg}=tensor {tuple(value.shape)} from Layer" in message
    assert f"expected: {kwarg}=None" in message
    assert EAGER_FIX in message
    assert info.value.argument == kwarg


@pytest.mark.parametrize("kwarg", list(REFUSED))
def test_a_refused_feature_that_is_off_is_accepted(kwarg: str) -> None:
    q, k, v = _qkv()
    out, _ = hfa.hf_attention(Layer(), q, k, v, None, **{kwarg: None})
    torch.testing.assert_close(out, attnkit.attention(q, k, v, causal=True).transpose(1, 2))


@pytest.mark.parametrize("value", [torch.ones(6), 0.5, True, "top-k"])
def test_an_unknown_keyword_is_refused_by_name(value: object) -> None:
    q, k, v = _qkv()
    with pytest.raises(AttentionInputError) as info:
        hfa.hf_attention(Layer(), q, k, v, None, topk_scores=value)
    message = str(info.value)
    assert "this model passes topk_scores=, which attnkit does not know" in message
    assert "it may change what attention computes, so attnkit does not ignore it" in message
    assert info.value.argument == "topk_scores"
    assert EAGER_FIX in message


def test_an_unknown_keyword_that_is_none_is_accepted() -> None:
    q, k, v = _qkv()
    out, _ = hfa.hf_attention(Layer(), q, k, v, None, topk_scores=None)
    torch.testing.assert_close(out, attnkit.attention(q, k, v, causal=True).transpose(1, 2))


HARMLESS_VALUES = {
    "position_ids": torch.arange(6)[None],
    "use_cache": True,
    "cache_position": torch.arange(6),
    "max_length_q": 6,
    "max_length_k": 6,
    "output_hidden_states": True,
    "output_router_logits": True,
    "num_items_in_batch": torch.tensor(12),
    "deterministic": True,
    "seq_idx": torch.zeros(1, 6, dtype=torch.int32),
    "encoder_hidden_states": torch.randn(1, 6, 32),
    "token_type_ids": torch.zeros(1, 6, dtype=torch.long),
    "layer_idx": 1,
}


def test_every_harmless_keyword_leaves_the_output_unchanged() -> None:
    harmless = {n for n, k in KWARGS.items() if k.kind == "harmless"}
    assert set(HARMLESS_VALUES) <= harmless
    q, k, v = _qkv()
    expected = attnkit.attention(q, k, v, causal=True).transpose(1, 2)
    for name in sorted(harmless):
        value = HARMLESS_VALUES.get(name, object())  # any value: it is never read
        out, weights = hfa.hf_attention(Layer(), q, k, v, None, **{name: value})
        assert weights is None, name
        torch.testing.assert_close(out, expected, msg=name)


def test_docs_hf_shows_the_table_as_it_is() -> None:
    assert markdown_table() in DOCS
    for name in KWARGS:
        assert f"`{name}`" in markdown_table()


def test_the_table_says_why_for_every_name() -> None:
    for name, entry in KWARGS.items():
        assert entry.kind in ("computed", "harmless", "refused"), name
        assert len(entry.what) > 10, name
        assert entry.models, name
        assert (entry.kind == "refused") == bool(entry.loss), name


# ---------------------------------------------------------------------------------------------
# the refusal docs/hf.md shows (DeepSeek-V3.2's indices are computed now: test_hf_dsa.py)


def test_the_refusal_the_docs_show_is_the_one_attnkit_raises() -> None:
    q, k, v = _qkv()
    with pytest.raises(AttentionInputError) as info:
        hfa.hf_attention(Layer(), q, k, v, None, block_indices=REFUSED["block_indices"][0])
    message = str(info.value)
    assert "this model uses MiniMax-M3's block-sparse key selection (block_indices=" in message
    assert EAGER_FIX in message
    assert message in DOCS  # docs/hf.md shows the message as it is


# ---------------------------------------------------------------------------------------------
# packed documents: cu_seq_lens_q / cu_seq_lens_k


def _packed() -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """One row of two documents (5 and 4 tokens), flash-attention's varlen arguments."""
    ids = batch()[0][1:]  # (1, T)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    cu = torch.tensor([0, 5, T], dtype=torch.int32)
    varlen = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 5, "max_length_k": 5}
    return ids, position_ids, varlen


def test_packed_documents_from_cu_seq_lens_match_eager_on_each_document() -> None:
    ref, ours = pair(tiny_config("qwen3"))
    ids, position_ids, varlen = _packed()
    with torch.no_grad():  # each document on its own, on eager
        first = ref(ids[:, :5]).logits
        second = ref(ids[:, 5:]).logits
        expected = torch.cat([first, second], dim=1)
        # as DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives them
        both = ours(ids, position_ids=position_ids, use_cache=False, **varlen).logits
        # cu_seq_lens alone (positions 0 .. T-1): eager lets the second document see the first
        alone = ours(ids, use_cache=False, **varlen).logits
        eager_alone = ref(ids, use_cache=False, **varlen).logits
        second_at_5 = ref(ids[:, 5:], position_ids=torch.arange(5, T)[None]).logits
    torch.testing.assert_close(both, expected, atol=ATOL_LOGITS, rtol=0)
    torch.testing.assert_close(alone[:, :5], expected[:, :5], atol=ATOL_LOGITS, rtol=0)
    torch.testing.assert_close(alone[:, 5:], second_at_5, atol=ATOL_LOGITS, rtol=0)
    assert (eager_alone[:, 5:] - second_at_5).abs().max() > 1e-3  # eager mixed the documents


@pytest.mark.parametrize(
    ("change", "argument", "problem"),
    [
        ({"cu_seq_lens_k": None}, "cu_seq_lens_k", "cu_seq_lens_q was given without"),
        ({"cu_seq_lens_q": torch.tensor([0, 5, 8])}, "cu_seq_lens_q",
         "cu_seq_lens_q does not cut the layer's 9 query positions into documents"),
        ({"cu_seq_lens_k": torch.tensor([0.0, 9.0])}, "cu_seq_lens_k",
         "cu_seq_lens_k must be the cumulative key lengths"),
        ({"cu_seq_lens_q": torch.tensor([0, 6, 5, 9])}, "cu_seq_lens_q", "does not cut"),
    ],
)  # fmt: skip
def test_cu_seq_lens_that_do_not_describe_the_row_are_refused(
    change: dict[str, Any], argument: str, problem: str
) -> None:
    q, k, v = (torch.randn(1, 4, T, 8) for _ in range(3))
    varlen = {**_packed()[2], **change}
    with pytest.raises(AttentionInputError) as info:
        hfa.hf_attention(Layer(), q, k, v, None, **varlen)
    assert problem in str(info.value)
    assert info.value.argument == argument
    assert "DataCollatorWithFlattening" in str(info.value)


@pytest.mark.parametrize(
    ("cu", "got"),
    [
        (torch.tensor([0.0, 9.0]), "cu_seq_lens_k (1-D: 2, ) dtype=torch.float32"),
        (torch.tensor([0, 9], dtype=torch.complex64),
         "cu_seq_lens_k (1-D: 2, ) dtype=torch.complex64"),
        (torch.tensor([True, False]), "cu_seq_lens_k (1-D: 2, ) dtype=torch.bool"),
        (torch.tensor([[0, 5, 9]]), "cu_seq_lens_k (2-D: 1, 3) dtype=torch.int64"),
        (torch.tensor([9]), "cu_seq_lens_k (1-D: 1, ) dtype=torch.int64"),
        ([0, 5, 9], "cu_seq_lens_k: list"),
    ],
)  # fmt: skip
def test_cu_seq_lens_that_are_no_cumulative_lengths_are_shown_as_they_came(
    cu: object, got: str
) -> None:
    """Not a 1-D integer tensor of two or more entries (a complex one too): refused before its
    values are read, with its shape and dtype as every attnkit message writes them."""
    q, k, v = (torch.randn(1, 4, T, 8) for _ in range(3))
    varlen = {**_packed()[2], "cu_seq_lens_k": cu}
    with pytest.raises(AttentionInputError) as info:
        hfa.hf_attention(Layer(), q, k, v, None, **varlen)
    assert info.value.argument == "cu_seq_lens_k"
    assert info.value.got == got
    assert "cu_seq_lens_k must be the cumulative key lengths" in str(info.value)
    assert info.value.expected == "a 1-D integer tensor (documents + 1,) starting at 0"


def test_cu_seq_lens_with_a_batch_of_rows_are_refused() -> None:
    q, k, v = (torch.randn(2, 4, T, 8) for _ in range(3))
    with pytest.raises(AttentionInputError) as info:
        hfa.hf_attention(Layer(), q, k, v, None, **_packed()[2])
    assert "cut one packed row into documents, but the batch has 2 rows" in str(info.value)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("is_causal", [True, False])
def test_cu_seq_lens_without_a_mask_keep_the_layers_own_rule(
    window: int | None, is_causal: bool
) -> None:
    """A layer that makes no mask: the documents come on top of is_causal and the window."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, T, 8, generator=g) for _ in range(3))
    rule = {"is_causal": is_causal, "sliding_window": window, "output_attentions": True}
    out, weights = hfa.hf_attention(Layer(), q, k, v, None, **rule, **_packed()[2])
    doc = torch.tensor([0] * 5 + [1] * 4)
    allowed = doc[:, None] == doc[None, :]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    if is_causal:
        allowed &= j <= i
        if window is not None:
            allowed &= j > i - window
    expected = attnkit.attention(q, k, v, mask=allowed, return_weights=True)
    torch.testing.assert_close(out, expected.output.transpose(1, 2))
    assert weights is not None
    torch.testing.assert_close(weights, expected.weights)
    assert not weights[..., ~allowed].any()
