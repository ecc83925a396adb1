"""The keyword arguments transformers' attention layers pass to ``attn_implementation="attnkit"``.

Dimension legend: B batch, H query heads, L query length, S key length.

Every model's attention layer calls the registered attention function as ``fn(module, query,
key, value, attention_mask, name=value, ..., **kwargs)``: the names it writes itself and, through
``**kwargs``, what the model's ``forward`` was given (``position_ids``, ``use_cache``,
``output_attentions``, flash-attention's ``cu_seq_lens_q``, the loss's ``shift_labels`` ...).
:func:`classify` says what attnkit does with each name: attnkit **computes** it, it is
**harmless** (it cannot change the result: why is said next to it), or it is **refused** with
the feature it carries and the fix. First the table :data:`KWARGS`; for a name the table lacks,
the declarations of the installed transformers (:mod:`attnkit.interop.hf_declarations`): a
loss argument (``LossKwargs``, an optional parameter of a loss function in ``LOSS_MAPPING``)
is harmless, as it is for eager. Any other name is refused unless its value is ``None`` (a
feature that is off), and the message names it, and the declaration that lists it where one
does (``TransformersKwargs``, ``FlashAttentionKwargs``): attnkit never runs a model with a
different attention than the model asks for.

The table was built from transformers 5.24's declarations (``TransformersKwargs``,
``FlashAttentionKwargs``, the loss functions' parameters), from every
``attention_interface(...)`` call in its models, and from what reached the function when tiny
random models of each type ran on attnkit; the docs' page ``docs/hf.md`` shows it, with the
rules (:data:`RULES`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from attnkit.errors import AttentionInputError, is_int_tensor, tensor_got
from attnkit.interop import hf_declarations

__all__ = [
    "KWARGS",
    "RULES",
    "SINKS_OUTSIDE_WEIGHTS_MODEL_TYPES",
    "Kwarg",
    "check_kwargs",
    "classify",
    "collecting_attentions",
    "markdown_table",
    "packed_documents",
    "shown",
]

#: ``config.model_type`` of the models whose eager attention applies ``s_aux`` as a scale on
#: the output (``sigmoid(logsumexp(scores) - sink)``, the same output as a sink column in the
#: softmax) and returns the weights *before* it: their weights are returned renormalised to
#: sum to 1 over the keys, as eager's. gpt-oss and the others return the weights with the
#: sink's share taken out, as attnkit computes them.
SINKS_OUTSIDE_WEIGHTS_MODEL_TYPES = frozenset({"granite_swa", "granitemoe_swa"})

EAGER_FIX = (
    'load this model with attn_implementation="eager" (or call '
    'model.set_attn_implementation("eager"))'
)


@dataclass(frozen=True)
class Kwarg:
    """What attnkit does with one keyword argument of the attention function."""

    kind: Literal["computed", "harmless", "refused"]
    #: computed: what attnkit does with it; harmless: why it cannot change the result;
    #: refused: the model feature it carries (the message says ``this model uses <feature>``)
    what: str
    #: which models pass it (for the docs' table)
    models: str
    #: refused: what running without it would lose
    loss: str = ""


def _computed(what: str, models: str) -> Kwarg:
    return Kwarg("computed", what, models)


def _harmless(why: str, models: str) -> Kwarg:
    return Kwarg("harmless", why, models)


def _refused(feature: str, models: str, loss: str) -> Kwarg:
    return Kwarg("refused", feature, models, loss)


_BOOKKEEPING = "bookkeeping of the model's forward (caches, outputs); eager ignores it"
_LOSS = (
    "a loss argument: the loss function reads it after the layers (`shift_labels`: the labels "
    "shifted by the caller, as context-parallel training gives them); eager ignores it"
)
_CONSUMED = (
    "the layer's or the model's own inputs (states, caches, rotary tables, encoder states, "
    "token ids, pixels, labels, the vision tower's cut points): q, k, v and the mask were "
    "made from them before the call; eager ignores them"
)

KWARGS: dict[str, Kwarg] = {
    # computed: they reach attnkit.attention
    "dropout": _computed("`dropout_p` (on the weights; models pass 0 outside training)", "all"),
    "scaling": _computed("`scale` (multiplies q @ k^T; `None`: 1/sqrt(D))", "all"),
    "is_causal": _computed(
        "`causal` when the layer gets no mask (the mask holds the rule otherwise, as on eager)",
        "decoders, encoders that turn it off (ViT, SAM, ...)",
    ),
    "sliding_window": _computed(
        "a causal window when the layer gets no mask (the mask holds the window otherwise, "
        "as on eager)",
        "Mistral, Qwen2, Gemma 2/3, Cohere 2, gpt-oss, ModernBERT decoder, ... (70)",
    ),
    "softcap": _computed("`softcap` (tanh logit soft-capping)", "Gemma 2, T5Gemma, VaultGemma"),
    "s_aux": _computed(
        "`sinks` (one learned attention sink per head, `(H,)`; Granite SWA's weights are "
        "returned before the sink's share, as its eager returns them)",
        "gpt-oss, DeepSeek-V4, MiMo-V2-Flash, Granite SWA, HunYuan V4, Flint, ...",
    ),
    "output_attentions": _computed(
        "`return_weights` (the weights `(B, H, L, S)` are returned; so they are whenever "
        "transformers' output capturing collects attentions)",
        "models that hand it on; GPT-2, GPTBigCode, OPT and others drop it before their "
        "layers, and the capture context says it instead",
    ),
    "cu_seq_lens_q": _computed(
        "packed documents (flash-attention's varlen form, one packed row, B = 1): a query "
        "attends only to keys of its own document, on top of the mask",
        "any model, from `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`",
    ),
    "cu_seq_lens_k": _computed("the keys' documents, with `cu_seq_lens_q`", "as above"),
    # harmless: they cannot change what attention computes
    "max_length_q": _harmless(
        "flash-attention's buffer size; the lengths come from the tensors", "as cu_seq_lens_q"
    ),
    "max_length_k": _harmless("as max_length_q", "as cu_seq_lens_k"),
    "position_ids": _harmless(
        "the positions the rotary embeddings and the mask were built from (transformers builds "
        "packed sequences' mask from them); attention reads the mask",
        "every model that takes position ids",
    ),
    **dict.fromkeys(
        [
            "use_cache",
            "cache_position",
            "layer_idx",
            "output_hidden_states",
            "output_router_logits",
            "return_dict",
            "logits_to_keep",
        ],
        _harmless(_BOOKKEEPING, "any model (transformers' forward arguments)"),
    ),
    **dict.fromkeys(
        ["num_items_in_batch", "shift_labels", "ignore_index"],
        _harmless(_LOSS, "any model trained with transformers' loss functions"),
    ),
    **dict.fromkeys(
        [
            "hidden_states",
            "position_embeddings",
            "cache",
            "past_key_values",
            "layer_past",
            "key_value_states",
            "encoder_hidden_states",
            "encoder_attention_mask",
            "cross_attention_states",
            "shared_kv_states",
            "prev_topk_indices",
            "token_type_ids",
            "mm_token_type_ids",
            "cu_seqlens",
            "max_seqlen",
            "input_ids",
            "inputs_embeds",
            "pixel_values",
            "pixel_values_videos",
            "image_grid_thw",
            "video_grid_thw",
            "input_features",
            "labels",
        ],
        _harmless(_CONSUMED, "layers that take them by `**kwargs` and pass them on"),
    ),
    "seq_idx": _harmless(
        "the Mamba layers' document index; the attention layers' documents are in the mask "
        "(or cu_seq_lens_q)",
        "hybrid Mamba models (Bamba, ...)",
    ),
    "deterministic": _harmless(
        "flash-attention's choice of backward kernel; eager ignores it",
        "ModernBERT",
    ),
    "indices": _computed(
        "`masks.selected_keys(indices)` (DeepSeek-V3.2's DSA top-k keys, `(B, L, k)`), "
        "intersected with the mask, as eager scatters them into it; the blocked backend "
        "gathers each query's k keys (no L x S)",
        "DeepSeek-V3.2, GLM-5 (glm_moe_dsa), Mistral Large 4, HunYuan V4, A.X K2, dots3",
    ),
    "position_bias": _computed(
        "added to the scores as eager adds it (a float mask (B or 1, H, L, S) inside the mask's "
        "spec: `spec & DenseMask(position_bias)`); where it trains, auto takes a backend that "
        "differentiates it",
        "T5, mT5, UMT5, LongT5, Switch, UDOP, Pix2Struct, Pop2Piano, LayoutLMv3, SeamlessM4T, "
        "Inkling, ...",
    ),
    "sinks": _computed(
        "per-token `sinks` (one logit per query row and head, `(B, H, L, 1)`, the extra column "
        "eager joins to every row's softmax) passed as `(B, H, L)`; their gradient too",
        "Inkling 2",
    ),
    # refused: features attnkit does not compute
    "block_indices": _refused(
        "MiniMax-M3's block-sparse key selection (block_indices=...)",
        "MiniMax-M3-VL",
        "each query would attend to every key block, not the selected ones",
    ),
    "head_mask": _refused(
        "a head mask (head_mask)",
        "none in transformers 5.24 (older encoders passed it)",
        "a factor on each head's weights",
    ),
}


#: a loss argument the installed transformers declares and :data:`KWARGS` lacks
_LOSS_RULE = _harmless(
    "a loss argument, read from the installed transformers' declarations: the loss function "
    "reads it after the layers; eager ignores it",
    "any model trained with it",
)

#: the rules for a name :data:`KWARGS` lacks, as the docs' table shows them: (names, entry)
RULES: tuple[tuple[str, Kwarg], ...] = (
    (
        "any other loss argument transformers declares (in `LossKwargs`; an optional parameter "
        "of a loss function in `LOSS_MAPPING`: `reduction`, `outputs_class`, ...)",
        _LOSS_RULE,
    ),
    (
        "any other name whose value is not `None`",
        _refused(
            "a name attnkit does not know (the message names it, and the declaration that "
            "lists it: `TransformersKwargs`, `FlashAttentionKwargs`)",
            "a later transformers, a model's own argument",
            "it may change what attention computes",
        ),
    ),
)


def classify(name: str) -> Kwarg | None:
    """What attnkit does with the keyword ``name``: its :data:`KWARGS` entry; else, for a loss
    argument the installed transformers declares
    (:func:`attnkit.interop.hf_declarations.declared`), harmless; else ``None`` (unknown:
    refused unless its value is ``None``).

    >>> classify("scaling").kind, classify("shift_labels").kind, classify("topk_scores")
    ('computed', 'harmless', None)
    """
    entry = KWARGS.get(name)
    if entry is None and hf_declarations.declared().is_loss(name):
        return _LOSS_RULE
    return entry


def check_kwargs(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuse what :func:`classify` refuses, and any name it does not know whose value is not
    ``None``."""
    for name, value in kwargs.items():
        if value is None:
            continue
        entry = classify(name)
        if entry is not None and entry.kind != "refused":
            continue
        layer = type(module).__name__
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        model = f"{layer}, model_type {model_type!r}" if model_type else layer
        if entry is not None:
            problem = (
                f"this model uses {entry.what}, which attnkit does not compute yet; running "
                f"without it ({entry.loss}) would give a different model."
            )
            expected = f"{name}=None"
        else:
            where = ", ".join(hf_declarations.declared().where(name))
            known = (
                f"which transformers declares in {where} and attnkit does not classify yet"
                if where
                else "which attnkit does not know"
            )
            problem = (
                f"this model passes {name}=, {known}; it may change what attention computes, "
                "so attnkit does not ignore it."
            )
            expected = f"keyword arguments attnkit computes or knows to be harmless ({name}=None)"
        raise AttentionInputError(
            f"attnkit.interop.hf_attention ({layer})",
            name,
            problem,
            got=f"{name}={shown(value)} from {model}",
            expected=expected,
            fix=EAGER_FIX,
        )


def shown(value: object) -> str:
    """A keyword's value in an error's ``got``: ``tensor (1, 4, 6, 1)``, or its ``repr``."""
    return f"tensor {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)


def collecting_attentions() -> bool:
    """Whether transformers' output capturing is collecting attention weights right now.

    Models decorated with ``capture_outputs`` (GPT-2 and most others in transformers 5) take
    ``output_attentions`` from their arguments, record each attention layer's returned weights
    with a forward hook, and may not hand the flag on to the attention function; the active
    collector (``transformers.utils.output_capturing._active_collector``) holds a list per
    output being collected (``attentions``, ``cross_attentions``, ...).
    """
    for where in ("transformers.utils.output_capturing", "transformers.utils.generic"):
        collector = getattr(sys.modules.get(where), "_active_collector", None)
        if collector is not None:
            collected = collector.get()
            return bool(collected) and any(str(k).endswith("attentions") for k in collected)
    return False


def _cu_error(module: nn.Module, name: str, problem: str, got: str, expected: str) -> None:
    raise AttentionInputError(
        f"attnkit.interop.hf_attention ({type(module).__name__})",
        name,
        problem,
        got=got,
        expected=expected,
        fix="pass cu_seq_lens_q and cu_seq_lens_k of one packed row (input_ids (1, total), as "
        "DataCollatorWithFlattening makes them), or position_ids restarting at 0 for each "
        "document instead",
    )


def _doc_ids(module: nn.Module, name: str, cu: object, n: int, what: str) -> torch.Tensor:
    """``(n,)`` each position's document index, from cumulative lengths ``cu`` ``(docs + 1,)``."""
    if not (is_int_tensor(cu) and cu.dim() == 1 and cu.numel() >= 2):
        _cu_error(
            module,
            name,
            f"{name} must be the cumulative {what} lengths of the packed documents.",
            tensor_got(name, cu, None),
            "a 1-D integer tensor (documents + 1,) starting at 0",
        )
    assert isinstance(cu, torch.Tensor)
    if not torch.compiler.is_compiling():  # the values: a graph break under torch.compile
        steps = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or int(cu[-1]) != n or bool((steps < 0).any()):
            _cu_error(
                module,
                name,
                f"{name} does not cut the layer's {n} {what} positions into documents.",
                f"{name}={cu.tolist()}",
                f"0 = {name}[0] <= ... <= {name}[-1] = {n} (the layer's {what} length)",
            )
    positions = torch.arange(n, device=cu.device, dtype=cu.dtype)
    return torch.searchsorted(cu[1:].contiguous(), positions, right=True)


def packed_documents(
    module: nn.Module, kwargs: dict[str, Any], B: int, L: int, S: int
) -> torch.Tensor | None:
    """``(1, 1, L, S)`` bool, True where query and key are in the same document, from
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (flash-attention's varlen form of packed sequences);
    ``None`` when neither is given."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None:
        given, missing = ("cu_seq_lens_q", "cu_seq_lens_k")[:: 1 if cu_k is None else -1]
        _cu_error(
            module,
            missing,
            f"{given} was given without {missing}: the documents of the other side are unknown.",
            f"{given}=tensor, {missing}=None",
            "both, or neither",
        )
    if B != 1:
        _cu_error(
            module,
            "cu_seq_lens_q",
            "cu_seq_lens_q / cu_seq_lens_k cut one packed row into documents, but the batch "
            f"has {B} rows.",
            f"query (B={B}, L={L}), key (B={B}, S={S})",
            "B = 1 (the documents packed into one row)",
        )
    doc_q = _doc_ids(module, "cu_seq_lens_q", cu_q, L, "query")
    doc_k = _doc_ids(module, "cu_seq_lens_k", cu_k, S, "key")
    return (doc_q[:, None] == doc_k[None, :])[None, None]


def markdown_table() -> str:
    """:data:`KWARGS` and then :data:`RULES` as the table of ``docs/hf.md`` (names with the same
    entry share a row)."""
    rows: dict[Kwarg, list[str]] = {}
    for name, entry in KWARGS.items():
        rows.setdefault(entry, []).append(f"`{name}`")
    for rule, entry in RULES:
        rows.setdefault(entry, []).append(rule)
    lines = [
        "| keyword | attnkit | what it does, or why | models that pass it |",
        "|---|---|---|---|",
    ]
    for entry, names in rows.items():
        what = entry.what if entry.kind != "refused" else f"{entry.what}: {entry.loss}"
        lines.append(f"| {', '.join(names)} | {entry.kind} | {what} | {entry.models} |")
    return "\n".join(lines)
