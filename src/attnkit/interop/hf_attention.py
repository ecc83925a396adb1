"""attnkit as an attention implementation of Hugging Face ``transformers``.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
D head dim.

The two lines a user writes (transformers is imported by the first, not before)::

    attnkit.interop.register_hf()          # after `import attnkit.interop`
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnkit")

transformers asks an attention implementation for two functions; :func:`register_hf` registers
both under one name:

- the **mask function** :func:`hf_mask` (``AttentionMaskInterface``, in
  :mod:`attnkit.interop.hf_mask`) gets, once per forward,
  the mask *rule* (transformers' ``mask_function``: causal, sliding window, bidirectional ...),
  the 2-D padding mask and where the queries and keys start (``q_offset``, ``kv_offset``).
  Where attnkit can prove the rule, it returns a lazy mask carrying an attnkit mask spec
  (``causal() & sliding_window(w) & key_mask(keep)``) and block-sparse backends skip the
  empty blocks; anywhere else it returns transformers' own dense bool mask ``(B, 1, L, S)``
  (``sdpa_mask``): a causal or window rule is never dropped or guessed.
- the **attention function** :func:`hf_attention` (``AttentionInterface``) gets from every
  attention layer q ``(B, H, L, D)``, k and v ``(B, Hkv, S, D)`` (not repeated: attnkit serves
  grouped-query heads as they are) and that mask, and returns ``((B, L, H, D), weights)``;
  weights ``(B, H, L, S)`` when the model asks for ``output_attentions`` or transformers'
  output capturing collects attentions, else ``None``. Each keyword argument the layer
  passes is computed, known to be harmless, or refused
  (:data:`attnkit.interop.hf_kwargs.KWARGS`). A call with a spec and only keywords that leave
  it ``attention(q, k, v, mask=spec, scale=scaling)`` runs directly where one like it ran
  before (:func:`attnkit.backends.memo.run_direct`: every layer after the first of a decode
  step), before the keyword table is read.

The mask object flows through the model's code between the two: it is a
:class:`~attnkit.interop.hf_lazy_mask.LazyMask`, a tensor without values that carries the spec.
A model that hands it on untouched runs attnkit on the spec; a model that operates on it
(slices it, adds a bias) makes transformers' dense mask first, the one its ``sdpa`` path gets
(eager's float form for the models whose code adds float biases to it:
``FLOAT_MASK_MODEL_TYPES``), and attnkit runs with what the model made of it. A model
whose attention layers do not call the attention interface is refused by the mask function:
attnkit would never run, and its own attention would read attnkit's masks.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import re
from typing import Any

import torch
from torch import nn

from attnkit.backends import memo
from attnkit.errors import AttentionInputError
from attnkit.functional import attention
from attnkit.interop import hf_declarations
from attnkit.interop.hf_kwargs import (
    KWARGS,
    SINKS_OUTSIDE_WEIGHTS_MODEL_TYPES,
    check_kwargs,
    collecting_attentions,
    packed_documents,
    shown,
)
from attnkit.interop.hf_lazy_mask import LazyMask, spec_of
from attnkit.interop.hf_mask import (
    SUPPORTED,
    UNMASKED,
    WHERE,
    hf_mask,
    load_masking_utils,
)
from attnkit.masks import DenseMask, MaskSpec, causal, selected_keys, sliding_window

__all__ = [
    "SUPPORTED",
    "UNMASKED",
    "attention_arguments",
    "hf_attention",
    "hf_mask",
    "register_hf",
]


def register_hf(name: str = "attnkit") -> str:
    """Register attnkit in transformers as ``attn_implementation=name``; returns ``name``.

    Registers :func:`hf_attention` in ``AttentionInterface`` and :func:`hf_mask` in
    ``AttentionMaskInterface``, after which ``AutoModel*.from_pretrained(path,
    attn_implementation=name)``, ``from_config(config, attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` run the model's attention on attnkit.
    Reads the keyword arguments transformers declares
    (:func:`attnkit.interop.hf_declarations.declared`). Calling it again is harmless. Needs
    ``transformers>=5.4,<6`` (``pip install 'attnkit[hf]'``); without it, an ``ImportError``
    says so.

    Raises:
        AttentionInputError: ``name`` is not a plain name, or transformers already uses it
            for another implementation (``"sdpa"``, ``"eager"``, another library's).

    >>> from attnkit.interop import register_hf
    >>> register_hf()
    'attnkit'
    """
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise AttentionInputError(
            WHERE,
            "name",
            f"{name!r} is not a plain name for an attn_implementation.",
            got=f"name={name!r}",
            expected="letters, digits, '_', '-', '.' (transformers reads 'org/repo' as a hub "
            "kernel to download)",
            fix='register_hf("attnkit")',
        )
    masking_utils = load_masking_utils()
    modeling_utils = importlib.import_module("transformers.modeling_utils")
    interfaces = (
        (modeling_utils.ALL_ATTENTION_FUNCTIONS, hf_attention, "AttentionInterface"),
        (masking_utils.ALL_MASK_ATTENTION_FUNCTIONS, hf_mask, "AttentionMaskInterface"),
    )
    for interface, ours, title in interfaces:
        current = interface.get(name)
        if current is not None and current is not ours:
            owner = getattr(current, "__module__", "transformers")
            raise AttentionInputError(
                WHERE,
                "name",
                f"transformers' {title} already has an implementation named {name!r}.",
                got=f"name={name!r}, registered by {owner}",
                expected="a name that is free, or already attnkit's",
                fix='register_hf() (the name "attnkit") or another new name',
            )
    for interface, ours, _ in interfaces:
        interface.register(name, ours)
    hf_declarations.declared()  # the keyword declarations, read now: never while a model runs
    return name


# ---------------------------------------------------------------------------------------------
# the attention function


def _mask_and_causal(
    module: nn.Module,
    attention_mask: MaskSpec | torch.Tensor | None,
    is_causal: bool | None,
    window: int | None,
) -> tuple[MaskSpec | torch.Tensor | None, bool]:
    """What ``attention()`` gets: a spec or tensor holds the whole rule (as for ``eager``)."""
    if attention_mask is UNMASKED:
        return None, False
    if attention_mask is not None:
        return attention_mask, False
    # no mask (a model that made none): sdpa's rule, with the layer's window if it has one
    causal_flag = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if causal_flag and window is not None:
        return sliding_window(window), True
    return None, causal_flag


def _with_documents(
    mask: MaskSpec | torch.Tensor | None, causal_flag: bool, documents: torch.Tensor
) -> MaskSpec | torch.Tensor:
    """``mask`` and the causal rule (what :func:`_mask_and_causal` gave) and "a query sees only
    keys of its own document", as one mask."""
    if isinstance(mask, torch.Tensor):  # the whole rule (causal_flag is False with a mask)
        if mask.dtype == torch.bool:
            return mask & documents
        return mask.masked_fill(~documents, -math.inf)
    if causal_flag:
        mask = causal() if mask is None else mask & causal()
    return documents if mask is None else mask & DenseMask(documents)


def _with_selected(
    mask: MaskSpec | torch.Tensor | None,
    causal_flag: bool,
    indices: torch.Tensor,
    heads: int | None,
    sizes: tuple[int, int, int] | None,
) -> MaskSpec | torch.Tensor:
    """``mask`` and the causal rule (what :func:`_mask_and_causal` gave) and "a query attends
    only to its top-k keys" (DeepSeek-V3.2's DSA ``indices``, ``(B, L, k)`` or
    ``(B, Hkv, L, k)``), as one mask: eager's meaning (the indices scattered into the mask)."""
    keys = selected_keys(indices, heads=heads)
    if isinstance(mask, torch.Tensor):  # a dense mask the model built: the same, scattered
        if sizes is None:
            raise ValueError("a dense mask with indices= needs the call's sizes")
        chosen = keys.to_dense(sizes[1], sizes[2]).to(mask.device)  # (B, 1|H, L, S) bool
        if mask.dtype == torch.bool:
            return mask & chosen
        return mask.masked_fill(~chosen, -math.inf)
    if causal_flag:
        mask = causal() if mask is None else mask & causal()
    return keys if mask is None else mask & keys


def _with_bias(
    module: nn.Module,
    mask: MaskSpec | torch.Tensor | None,
    causal_flag: bool,
    bias: object,
) -> MaskSpec | torch.Tensor:
    """``mask`` and the causal rule (what :func:`_mask_and_causal` gave) and a relative position
    bias added to the scores (T5's and Inkling's ``position_bias``, ``(B|1, H, L, S)``), as one
    mask: eager's ``scores + position_bias + attention_mask``. Against a spec the bias is a
    float mask inside it (``spec & DenseMask(bias)``), so a block-sparse backend still skips
    the blocks the rule empties; where the bias trains, auto takes a backend that
    differentiates it."""
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        got = f"{type(bias).__name__}" + (
            f" {tuple(bias.shape)} {bias.dtype}" if isinstance(bias, torch.Tensor) else ""
        )
        raise AttentionInputError(
            f"attnkit.interop.hf_attention ({type(module).__name__})",
            "position_bias",
            "position_bias must be a float tensor (B|1, H, L, S), added to the scores",
            got=f"position_bias={got}",
            expected="a float tensor of the scores' shape, or one that broadcasts to it",
            fix="pass the bias the model computed (its relative_attention_bias), or None",
        )
    if isinstance(mask, torch.Tensor):  # the whole rule, as a tensor (eager's order of sums)
        if mask.dtype == torch.bool:
            return bias.masked_fill(~mask, -math.inf)
        return bias + mask
    if causal_flag:
        mask = causal() if mask is None else mask & causal()
    dense = DenseMask(bias)
    return dense if mask is None else mask & dense


def attention_arguments(
    module: nn.Module,
    attention_mask: MaskSpec | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    *,
    sizes: tuple[int, int, int] | None = None,
    heads: int | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """The keyword arguments :func:`attnkit.attention` (or :func:`attnkit.explain`) gets for
    one layer's call, as :func:`hf_attention` passes them: ``mask``, ``causal``, ``scale``,
    ``dropout_p``, ``softcap`` and ``sinks``. Arguments as for :func:`hf_attention`, and
    ``sizes`` ``(B, L, S)`` of the call (read from ``cu_seq_lens_q`` / ``cu_seq_lens_k`` when
    not given) and its query ``heads`` (for per-key/value-head DSA ``indices``); a model
    feature attnkit does not compute raises :class:`~attnkit.AttentionInputError`
    (:data:`attnkit.interop.hf_kwargs.KWARGS`).

    >>> import torch.nn as nn
    >>> attention_arguments(nn.Module(), None, is_causal=True, sliding_window=4)["causal"]
    True
    """
    check_kwargs(module, kwargs)
    attention_mask = spec_of(attention_mask)  # type: ignore[assignment]
    mask, causal_flag = _mask_and_causal(module, attention_mask, is_causal, sliding_window)
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        if sizes is None:  # the lengths the cumulative lengths end at
            ends = [kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k")]
            L, S = (int(e[-1]) if isinstance(e, torch.Tensor) and e.numel() else 0 for e in ends)
            sizes = (1, L, S)
        documents = packed_documents(module, kwargs, *sizes)
        if documents is not None:
            mask, causal_flag = _with_documents(mask, causal_flag, documents), False
    indices = kwargs.get("indices")
    if indices is not None:  # DSA: checked against the call's sizes by attnkit.attention
        mask, causal_flag = _with_selected(mask, causal_flag, indices, heads, sizes), False
    bias = kwargs.get("position_bias")
    if bias is not None:  # T5, Inkling: checked against the call's sizes by attnkit.attention
        mask, causal_flag = _with_bias(module, mask, causal_flag, bias), False
    return {
        "mask": mask,
        "causal": causal_flag,
        "scale": scaling,
        "dropout_p": dropout,
        "softcap": kwargs.get("softcap"),
        "sinks": _sinks(module, kwargs),
    }


def _sinks(module: nn.Module, kwargs: dict[str, Any]) -> Any:
    """The ``sinks`` of :func:`attnkit.attention` (which checks them): gpt-oss's ``s_aux``
    ``(H,)`` (one per head) as it is, or Inkling 2's per-token ``sinks`` ``(B, H, L, 1)`` (the
    column eager joins to the scores) as ``(B, H, L)``; ``None`` for neither."""
    s_aux, sinks = kwargs.get("s_aux"), kwargs.get("sinks")
    if sinks is None:
        return s_aux
    if s_aux is not None:
        layer = type(module).__name__
        raise AttentionInputError(
            f"attnkit.interop.hf_attention ({layer})",
            "sinks",
            "this layer passes both s_aux= (sinks per head) and sinks= (per token); eager "
            "joins only one column to the scores.",
            got=f"s_aux={shown(s_aux)}, sinks={shown(sinks)} from {layer}",
            expected="s_aux=None or sinks=None",
            fix="pass one of them (attnkit.attention(sinks=) takes (H,) or (B, H, L))",
        )
    if isinstance(sinks, torch.Tensor) and sinks.dim() == 4 and sinks.shape[-1] == 1:
        return sinks.squeeze(-1)
    return sinks


def hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: MaskSpec | torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention interface, on :func:`attnkit.attention`.

    Args:
        module: the calling attention layer (its ``is_causal`` and ``config`` are read).
        query: ``(B, H, L, D)``.
        key, value: ``(B, Hkv, S, D)``, not repeated (``H % Hkv == 0``).
        attention_mask: what :func:`hf_mask` returned (a lazy mask carrying a spec, or a
            bool mask ``(B, 1, L, S)``, True = may attend, or eager's float one), a mask the
            caller built (bool, or float added to the scores), or ``None`` (then ``is_causal``, else
            ``module.is_causal``, decides).
        **kwargs: what the layer passes by keyword, read by :func:`attention_arguments`:
            ``dropout`` (on the weights; models pass 0 outside training), ``scaling``
            (multiplies ``q @ k^T``; default ``1 / sqrt(D)``), ``is_causal``,
            ``sliding_window`` (used only with no mask: the mask holds the window otherwise),
            ``softcap`` (Gemma 2's logit soft-cap), ``s_aux`` (gpt-oss's attention sinks,
            ``(H,)``) and ``sinks`` (Inkling 2's per-token sinks, ``(B, H, L, 1)``, passed as
            ``(B, H, L)``), which go to :func:`attnkit.attention` as ``softcap`` and ``sinks``;
            ``output_attentions`` (else ``module.config.output_attentions``) asks for the
            weights, and so does transformers' output capturing when it collects attentions
            (GPT-2 and others do not hand the flag on); the models of
            ``SINKS_OUTSIDE_WEIGHTS_MODEL_TYPES`` get them without the sink's share, as their
            eager returns them. ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (packed documents, one
            row) keep each query to its own document, and ``indices`` (DeepSeek-V3.2's DSA
            top-k keys, ``(B, L, k)``) to its selected keys
            (:func:`attnkit.masks.selected_keys`, intersected with the mask);
            ``position_bias`` (T5's and Inkling's relative position bias,
            ``(B|1, H, L, S)``) is added to the scores. Arguments that
            cannot change the result (``position_ids``, ``use_cache``, ``max_length_q``, loss
            arguments such as ``shift_labels`` ...) are accepted; what attnkit does not
            compute (``block_indices``, ``head_mask``) and any unknown argument that is not
            ``None`` raise :class:`~attnkit.AttentionInputError`: the table is
            :data:`attnkit.interop.hf_kwargs.KWARGS`, with the rules of
            :func:`attnkit.interop.hf_kwargs.classify` for a name it lacks.

    Returns:
        ``(output (B, L, H, D) contiguous, weights (B, H, L, S) or None)``.
    """
    if isinstance(attention_mask, LazyMask):  # hf_mask's: its spec, unless values were written
        attention_mask = spec_of(attention_mask)  # type: ignore[assignment]
    want = _wants_weights(module, kwargs)
    if not want and isinstance(attention_mask, MaskSpec) and _plain(kwargs):
        # a call like an earlier one (every layer after the first, every decode step): run
        # directly, as attnkit.attention would after the same arguments (backends.memo)
        mask = None if attention_mask is UNMASKED else attention_mask
        out, _ = memo.run_direct(query, key, value, mask, False, kwargs.get("scaling"), "auto")
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
    sizes = (query.shape[0], query.shape[-2], key.shape[-2])
    heads = query.shape[1]
    common = attention_arguments(module, attention_mask, sizes=sizes, heads=heads, **kwargs)
    weights = None
    if want:
        out, weights = attention(query, key, value, return_weights=True, **common)
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        renormalise = (
            common["sinks"] is not None and model_type in SINKS_OUTSIDE_WEIGHTS_MODEL_TYPES
        )
        if weights is not None and renormalise:
            total = weights.sum(dim=-1, keepdim=True)  # 1 - the sink's share; 0: no key
            weights = weights / torch.where(total > 0, total, torch.ones_like(total))
    else:
        out = attention(query, key, value, **common)
    return out.transpose(1, 2).contiguous(), weights  # (B, L, H, D)


#: the keywords a call may pass and still run directly: those that cannot change the result,
#: and the ones :func:`_plain` checks or the mask spec makes moot (``is_causal`` and
#: ``sliding_window`` are read only without a mask)
_PLAIN = frozenset(n for n, e in KWARGS.items() if e.kind == "harmless") | {
    "dropout", "scaling", "is_causal", "sliding_window", "output_attentions",
}  # fmt: skip


def _plain(kwargs: dict[str, Any]) -> bool:
    """Whether a call with a mask spec and these keywords is, for :func:`attnkit.attention`,
    ``attention(q, k, v, mask=spec, scale=kwargs["scaling"])`` (what
    :func:`attention_arguments` makes of it): no dropout, soft-cap, sinks or documents, and
    nothing to refuse."""
    dropout = kwargs.get("dropout", 0.0)
    return kwargs.keys() <= _PLAIN and type(dropout) is float and dropout == 0.0


def _wants_weights(module: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether the layer's call asks for the weights: ``output_attentions`` passed, else the
    model's ``config.output_attentions``, or transformers' output capturing collecting them.
    (Read on every call of every layer, so the config's flag is read from the field where
    transformers keeps it, ``_output_attentions``, past the config's own
    ``__getattribute__`` and property, which cost about 3 us a call; through the attribute
    where the field is not there, and while torch.compile traces, which reads it once.)"""
    want = kwargs.get("output_attentions")
    if want is None:
        config = getattr(module, "config", None)
        fields: dict[str, Any] = {}
        if not torch.compiler.is_compiling():
            with contextlib.suppress(AttributeError):  # no config, or one without __dict__
                fields = object.__getattribute__(config, "__dict__")
        if "_output_attentions" in fields:
            want = fields["_output_attentions"]
        else:
            want = getattr(config, "output_attentions", False)
    return bool(want) or collecting_attentions()
