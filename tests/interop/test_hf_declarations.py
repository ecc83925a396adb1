"""Every keyword argument transformers declares for a model's ``forward(**kwargs)`` (what its
layers hand on to the attention function) is classified.

The declarations are read here from the installed transformers on their own (the TypedDicts'
``__annotations__``, the loss functions' signatures, the TypedDicts in the models' files) and
checked against :func:`attnkit.interop.hf_kwargs.classify`: a TypedDict's name is in the table,
a loss argument is harmless. ``shift_labels`` (the loss's shifted labels, which
``test_causal_lm_loss_honors_shift_labels`` of transformers' model tests passes) leaves the
logits as they are and gives eager's loss. A name transformers adds later is classified by the
same rules (declarations replaced by made-up ones), an unknown one refused by name.

Tolerances: logits and losses ``atol=1e-4`` (float32).
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import pytest
import torch

import attnkit
import attnkit.interop.hf_attention as hfa
from attnkit import AttentionInputError
from attnkit.interop import hf_declarations, register_hf
from attnkit.interop.hf_declarations import Declarations
from attnkit.interop.hf_kwargs import KWARGS, classify
from hf_tiny import ATOL_LOGITS, EAGER_FIX, Layer, batch, pair, tiny_config, transformers

register_hf()

generic = pytest.importorskip("transformers.utils.generic")
flash_utils = pytest.importorskip("transformers.modeling_flash_attention_utils")
loss_utils = pytest.importorskip("transformers.loss.loss_utils")


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 8, generator=g)
    k, v = torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    return q, k, v


# ---------------------------------------------------------------------------------------------
# the declarations, read here on their own


def _typed_dicts() -> dict[str, set[str]]:
    """The keys of transformers' kwargs TypedDicts: the library's, and those in model files."""
    found = {
        cls.__name__: set(cls.__annotations__)
        for cls in (generic.TransformersKwargs, flash_utils.FlashAttentionKwargs)
    }
    if hasattr(generic, "LossKwargs"):  # transformers 4.4x; not in 5.x so far
        found["LossKwargs"] = set(generic.LossKwargs.__annotations__)
    root = Path(inspect.getfile(transformers)).parent / "models"
    for path in sorted(root.glob("*/modeling_*.py")):
        source = path.read_text()
        if "TypedDict" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            bases = [getattr(b, "id", getattr(b, "attr", "")) for b in getattr(node, "bases", [])]
            if isinstance(node, ast.ClassDef) and "TypedDict" in bases:
                keys = {
                    s.target.id
                    for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                }
                found.setdefault(f"{path.parent.name}.{node.name}", set()).update(keys)
    return found


def _loss_arguments() -> dict[str, set[str]]:
    """Each loss function's optional parameters (the ones ``**kwargs`` carries to it)."""
    found: dict[str, set[str]] = {}
    for fn in loss_utils.LOSS_MAPPING.values():
        params = inspect.signature(fn).parameters.values()
        optional = {p.name for p in params if p.default is not p.empty and p.kind != p.VAR_KEYWORD}
        if optional:
            found.setdefault(fn.__name__, set()).update(optional)
    return found


def test_every_name_in_transformers_typed_dicts_is_in_the_table() -> None:
    typed = _typed_dicts()
    assert {"TransformersKwargs", "FlashAttentionKwargs"} <= set(typed)
    assert len(typed["TransformersKwargs"]) >= 10  # transformers 5.24: 11 names
    assert any(name.endswith("GraniteFlashAttentionKwargs") for name in typed)  # a model's own
    missing = {
        where: sorted(n for n in names if n not in KWARGS and classify(n) is None)
        for where, names in typed.items()
    }
    assert {where: names for where, names in missing.items() if names} == {}
    # LossKwargs' names are harmless by rule; every other TypedDict's names are in the table
    outside = {n for w, names in typed.items() if w != "LossKwargs" for n in names} - set(KWARGS)
    assert outside == set()


def test_what_changes_attention_is_computed_and_the_rest_passes() -> None:
    typed = _typed_dicts()
    kinds = {n: KWARGS[n].kind for n in typed["FlashAttentionKwargs"]}
    assert kinds == {
        "cu_seq_lens_q": "computed",  # packed documents
        "cu_seq_lens_k": "computed",
        "max_length_q": "harmless",  # a buffer size: the lengths come from the tensors
        "max_length_k": "harmless",
    }
    for name in typed["TransformersKwargs"]:
        assert KWARGS[name].kind in ("computed", "harmless"), name


def test_every_loss_argument_transformers_declares_is_harmless() -> None:
    losses = _loss_arguments()
    assert "shift_labels" in losses["ForCausalLMLoss"]
    names = {n for found in losses.values() for n in found}
    assert {"shift_labels", "ignore_index", "num_items_in_batch", "reduction"} <= names
    kinds = {n: getattr(classify(n), "kind", None) for n in sorted(names)}
    assert kinds == dict.fromkeys(sorted(names), "harmless")
    assert KWARGS["shift_labels"].kind == "harmless"  # in the table too: the docs show it


def test_the_reader_reads_what_transformers_declares() -> None:
    declared = hf_declarations.declared()
    typed = _typed_dicts()
    for name in ("TransformersKwargs", "FlashAttentionKwargs"):
        assert declared.names[name] == typed[name], name
    assert declared.kinds["TransformersKwargs"] == "forward"
    assert declared.kinds["FlashAttentionKwargs"] == "attention"
    for title, names in _loss_arguments().items():
        assert declared.names[title] == names, title
        assert declared.kinds[title] == "loss", title
    assert declared.where("shift_labels") == ["ForCausalLMLoss"]
    assert declared.is_loss("reduction")
    assert not declared.is_loss("cu_seq_lens_q")


def test_nothing_is_read_before_transformers_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_declarations, "_read", [])
    monkeypatch.delitem(sys.modules, "transformers")
    assert hf_declarations.declared() == Declarations()
    assert hf_declarations._read == []  # read later, once transformers is imported


# ---------------------------------------------------------------------------------------------
# shift_labels: passes, changes nothing


def test_shift_labels_passes_the_attention_function_unchanged() -> None:
    q, k, v = _qkv()
    expected, _ = hfa.hf_attention(Layer(), q, k, v, None)
    labels = torch.randint(0, 64, (1, 6))
    for extra in ({"shift_labels": labels}, {"ignore_index": -100}, {"reduction": "sum"}):
        out, weights = hfa.hf_attention(Layer(), q, k, v, None, **extra)
        assert weights is None
        torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=str(extra))


@pytest.mark.parametrize("name", ["qwen3", "gpt2"])
def test_a_causal_lm_loss_honors_shift_labels_as_on_eager(name: str) -> None:
    """transformers' ``test_causal_lm_loss_honors_shift_labels``, on attnkit: the labels
    shifted by the caller give the loss of ``labels``; other shifted labels give eager's."""
    ref, ours = pair(tiny_config(name))
    ids, mask = batch()
    labels = ids.masked_fill(mask == 0, -100)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    other = torch.randint(0, 64, labels.shape, generator=torch.Generator().manual_seed(3))
    other = other.masked_fill(mask == 0, -100)  # padded rows' logits differ from eager's
    with torch.no_grad():
        plain = ours(ids, attention_mask=mask, labels=labels)
        same = ours(ids, attention_mask=mask, labels=labels, shift_labels=shifted)
        honored = ours(ids, attention_mask=mask, labels=labels, shift_labels=other)
        eager = ref(ids, attention_mask=mask, labels=labels, shift_labels=other)
    torch.testing.assert_close(same.logits, plain.logits, rtol=0, atol=0)
    torch.testing.assert_close(same.loss, plain.loss, rtol=0, atol=0)
    torch.testing.assert_close(honored.loss, eager.loss, atol=ATOL_LOGITS, rtol=0)
    assert (honored.loss - plain.loss).abs() > 1e-3  # the shifted labels were read


# ---------------------------------------------------------------------------------------------
# a name transformers adds later; an unknown name


LATER = Declarations(
    {
        "LossKwargs": frozenset({"label_smoothing", "window_size"}),
        "FlashAttentionKwargs": frozenset({"window_size", "cu_seq_lens_q"}),
        "TransformersKwargs": frozenset({"chunk_ids", "label_smoothing"}),
    },
    {"LossKwargs": "loss", "FlashAttentionKwargs": "attention", "TransformersKwargs": "forward"},
)


def test_a_loss_argument_transformers_adds_later_is_harmless(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hf_declarations, "_read", [LATER])
    assert classify("label_smoothing") is not None
    assert getattr(classify("label_smoothing"), "kind", None) == "harmless"
    q, k, v = _qkv()
    out, _ = hfa.hf_attention(Layer(), q, k, v, None, label_smoothing=0.1)
    torch.testing.assert_close(out, attnkit.attention(q, k, v, causal=True).transpose(1, 2))


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("window_size", "LossKwargs, FlashAttentionKwargs"),  # flash-attention's: not harmless
        ("chunk_ids", "TransformersKwargs"),
    ],
)
def test_any_other_name_transformers_adds_later_is_refused_naming_its_declaration(
    monkeypatch: pytest.MonkeyPatch, name: str, where: str
) -> None:
    monkeypatch.setattr(hf_declarations, "_read", [LATER])
    assert classify(name) is None
    q, k, v = _qkv()
    with pytest.raises(AttentionInputError) as info:
        hfa.hf_attention(Layer(), q, k, v, None, **{name: torch.ones(2)})
    message = str(info.value)
    assert (
        f"this model passes {name}=, which transformers declares in {where} and attnkit does "
        "not classify yet; it may change what attention computes, so attnkit does not ignore "
        "it." in message
    )
    assert info.value.argument == name
    out, _ = hfa.hf_attention(Layer(), q, k, v, None, **{name: None})  # off: accepted
    torch.testing.assert_close(out, attnkit.attention(q, k, v, causal=True).transpose(1, 2))


def test_an_unknown_keyword_through_a_model_is_refused_with_its_name() -> None:
    _, ours = pair(tiny_config("qwen3"))
    ids, mask = batch()
    with pytest.raises(AttentionInputError) as info, torch.no_grad():
        ours(ids, attention_mask=mask, topk_scores=torch.ones(2, 9))
    assert str(info.value).splitlines() == [
        "attnkit.interop.hf_attention (Qwen3Attention): this model passes topk_scores=, which "
        "attnkit does not know; it may change what attention computes, so attnkit does not "
        "ignore it.",
        "  got:      topk_scores=tensor (2, 9) from Qwen3Attention, model_type 'qwen3'",
        "  expected: keyword arguments attnkit computes or knows to be harmless"
        + " (topk_scores=None)",
        "  " + EAGER_FIX + ' (or call model.set_attn_implementation("eager"))',
    ]
    assert info.value.argument == "topk_scores"
