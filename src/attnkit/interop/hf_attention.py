"""attnkit as an attention implementation of Hugging Face ``transformers``.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
D head dim.

The two lines a user writes (transformers is imported by the first, not before)::

    attnkit.interop.register_hf()          # after `import attnkit.interop`
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnkit")

transformers asks an attention implementation for two functions; :func:`register_hf` registers
both under one name:

- the **mask function** :func:`hf_mask` (``AttentionMaskInterface``) gets, once per forward,
  the mask *rule* (transformers' ``mask_function``: causal, sliding window, bidirectional ...),
  the 2-D padding mask and where the queries and keys start (``q_offset``, ``kv_offset``).
  Where attnkit can prove the rule, it returns an attnkit mask spec
  (``causal() & sliding_window(w) & key_mask(keep)``) and block-sparse backends skip the
  empty blocks; anywhere else it returns transformers' own dense bool mask ``(B, 1, L, S)``
  (``sdpa_mask``): a causal or window rule is never dropped or guessed.
- the **attention function** :func:`hf_attention` (``AttentionInterface``) gets from every
  attention layer q ``(B, H, L, D)``, k and v ``(B, Hkv, S, D)`` (not repeated: attnkit serves
  grouped-query heads as they are) and that mask, and returns ``((B, L, H, D), weights)``;
  weights ``(B, H, L, S)`` when the model asks for ``output_attentions``, else ``None``.

The mask object flows through the model's code between the two. Models that hand it on
untouched get specs (:data:`SPEC_MODEL_TYPES`, each verified by a test against ``eager``);
every other model gets the dense mask, which is what its ``sdpa`` path gets too.
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType, ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnkit.errors import AttentionInputError
from attnkit.functional import attention
from attnkit.masks import MaskSpec, causal, key_mask, sliding_window, unmasked

__all__ = [
    "SPEC_MODEL_TYPES",
    "SUPPORTED",
    "attention_arguments",
    "hf_attention",
    "hf_mask",
    "register_hf",
]

WHERE = "attnkit.interop.register_hf"
#: the transformers versions whose mask and attention interfaces attnkit uses (the `hf` extra)
SUPPORTED = "transformers>=5.4,<6"
_LOWEST = (5, 4)  # the first with the mask interface's q_length / q_offset arguments
INSTALL = "pip install 'attnkit[hf]'"

#: ``config.model_type`` of the models whose code hands the mask from the mask function to
#: the attention function untouched (verified against ``eager`` in
#: ``tests/interop/test_hf_attention.py``); other models get transformers' dense mask.
SPEC_MODEL_TYPES = frozenset({"bert", "llama", "mistral", "qwen2"})

#: ``transformers.masking_utils`` once :func:`register_hf` has checked it (read by
#: :func:`hf_mask`, which must not import while ``torch.compile`` traces it)
_MASKING_UTILS: ModuleType | None = None


def _transformers() -> ModuleType:
    """``transformers.masking_utils``, after checking that transformers is there and recent."""
    try:
        transformers = importlib.import_module("transformers")
        masking_utils = importlib.import_module("transformers.masking_utils")
    except ImportError as e:
        raise ImportError(
            f"{WHERE}: Hugging Face transformers is not installed; attnkit's "
            f"attn_implementation needs {SUPPORTED}. Install it with: {INSTALL}"
        ) from e
    version = str(transformers.__version__)
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) < _LOWEST:
        raise ImportError(
            f"{WHERE}: transformers {version} is installed; attnkit's attn_implementation "
            f"needs {SUPPORTED} (its mask interface takes q_length and q_offset). "
            f"Upgrade it with: {INSTALL}"
        )
    return masking_utils


def register_hf(name: str = "attnkit") -> str:
    """Register attnkit in transformers as ``attn_implementation=name``; returns ``name``.

    Registers :func:`hf_attention` in ``AttentionInterface`` and :func:`hf_mask` in
    ``AttentionMaskInterface``, after which ``AutoModel*.from_pretrained(path,
    attn_implementation=name)``, ``from_config(config, attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` run the model's attention on attnkit.
    Calling it again is harmless. Needs ``transformers>=5.4,<6`` (``pip install
    'attnkit[hf]'``); without it, an ``ImportError`` says so.

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
    global _MASKING_UTILS
    masking_utils = _MASKING_UTILS = _transformers()
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
    return name


# ---------------------------------------------------------------------------------------------
# the mask function: transformers' rule -> an attnkit spec where provable, else its dense mask


#: transformers' bidirectional rule without padding: run as ``mask=None, causal=False``
UNMASKED: MaskSpec = unmasked()


@dataclass
class _Rule:
    """What a transformers ``mask_function`` says, as a conjunction of known terms."""

    causal: bool = False
    after: list[int] = field(default_factory=list)  # kv > q - w (sliding_window_overlay)
    near: list[int] = field(default_factory=list)  # |q - kv| <= w (bidirectional window)
    keys: list[torch.Tensor] = field(default_factory=list)  # padding tables (B, >= kv_offset+S)

    @property
    def positional(self) -> bool:
        """Whether the rule compares query and key positions (then offsets must be proven)."""
        return self.causal or bool(self.after) or bool(self.near)


def _closure(fn: Callable[..., Any]) -> dict[str, Any]:
    cells = fn.__closure__ or ()
    return {n: c.cell_contents for n, c in zip(fn.__code__.co_freevars, cells, strict=True)}


@functools.cache
def _templates(mu: ModuleType) -> dict[str, Any]:
    """The code objects of the closures that masking_utils' rule factories return."""
    table = torch.ones(1, 1, dtype=torch.bool)
    return {
        "and": mu.and_masks(mu.causal_mask_function).__code__,
        "or": mu.or_masks(mu.causal_mask_function).__code__,
        "after": mu.sliding_window_overlay(1).__code__,
        "near": mu.sliding_window_bidirectional_overlay(1).__code__,
        "keys": mu.padding_mask_function(table).__code__,
    }


def _read_rule(mu: ModuleType, fn: object, rule: _Rule | None = None) -> _Rule | None:
    """``fn`` as a :class:`_Rule`, or ``None`` where any part of it is not recognised."""
    rule = _Rule() if rule is None else rule
    if fn is mu.causal_mask_function:
        rule.causal = True
        return rule
    if fn is mu.bidirectional_mask_function:
        return rule
    code = getattr(fn, "__code__", None)
    if code is None or not callable(fn):
        return None
    kind = next((k for k, c in _templates(mu).items() if c is code), None)
    cell = _closure(fn) if kind is not None else {}
    if kind == "and" or (kind == "or" and len(cell["mask_functions"]) == 1):
        for part in cell["mask_functions"]:
            if _read_rule(mu, part, rule) is None:
                return None
        return rule
    window = cell.get("sliding_window")
    if kind in ("after", "near") and type(window) is int and window >= 1:
        (rule.after if kind == "after" else rule.near).append(window)
        return rule
    table = cell.get("padding_mask")
    if kind == "keys" and isinstance(table, torch.Tensor) and table.dtype == torch.bool:
        rule.keys.append(table)
        return rule
    return None  # or_masks of several rules, chunks, packed sequences, overlays, anything new


def _keep(table: torch.Tensor, kv_offset: int, S: int, B: int) -> torch.Tensor | None:
    """The ``(B, S)`` real-key columns of a padding table indexed by absolute key position."""
    if table.dim() != 2 or table.shape[0] != B or table.dtype != torch.bool:
        return None
    if table.shape[1] < kv_offset + S:  # as transformers pads it: missing keys are padding
        table = F.pad(table, (0, kv_offset + S - table.shape[1]))
    return table[:, kv_offset : kv_offset + S]


def _spec(
    rule: _Rule, padding: torch.Tensor | None, B: int, L: int, S: int, q_off: object, kv_off: int
) -> MaskSpec | None:
    """The rule as an attnkit spec, or ``None`` where that cannot be proven."""
    if rule.positional and not (type(q_off) is int and q_off + L == kv_off + S):
        return None  # attnkit's specs align the last query with the last key
    if rule.after and not rule.causal:
        return None  # the one-sided window means causal() & sliding_window(w) only with causal
    keep: torch.Tensor | None = None
    for table in rule.keys + ([padding] if padding is not None else []):
        cols = _keep(table, kv_off, S, B)
        if cols is None:
            return None
        keep = cols if keep is None else keep & cols
    parts = [causal()] if rule.causal else []
    parts += [sliding_window(w) for w in rule.after]  # with causal(): itself and w - 1 before
    parts += [sliding_window(w + 1) for w in rule.near]  # |i + S - L - j| < w + 1
    if keep is not None and not bool(keep.all()):
        parts.append(key_mask(keep))
    if not parts:
        return UNMASKED
    spec = parts[0]
    for part in parts[1:]:
        spec = spec & part
    return spec


def _building_masks_for_generate() -> bool:
    """Whether transformers' ``create_masks_for_generate`` asked: ``generate`` builds the masks
    of a compileable (static) cache ahead of the forward and hands them to the model as its
    ``attention_mask``, where transformers' code takes only a 4-D tensor (or a BlockMask)."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_code.co_name == "create_masks_for_generate":
            return True
        frame = frame.f_back
    return False


def hf_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> MaskSpec | torch.Tensor:
    """transformers' mask interface: an attnkit spec where the rule is proven, else dense.

    Called by transformers' ``create_causal_mask`` / ``create_sliding_window_causal_mask`` /
    ``create_bidirectional_mask`` with the keyword arguments of its ``sdpa_mask``: the
    queries are positions ``q_offset .. q_offset + L - 1`` and the keys ``kv_offset ..
    kv_offset + S - 1``; ``attention_mask`` is the 2-D padding mask ``(B, >= kv_offset + S)``,
    True = a real token. A spec is returned when the model is in :data:`SPEC_MODEL_TYPES`,
    every part of ``mask_function`` is recognised (causal, sliding-window overlay,
    bidirectional, padding, and their ``and_masks``) and, for a rule that compares positions,
    ``q_offset + L == kv_offset + S`` (no cache, ``DynamicCache``, sliding-window caches).
    Anything else (static caches, packed sequences, chunks, image-token overlays, rules
    attnkit does not know) gets ``sdpa_mask``'s dense bool mask ``(B, 1, L, S)``; so do the
    masks ``generate`` builds ahead for a compileable cache (the model's code takes only a
    tensor there) and calls traced by ``torch.compile`` (reading the rule inspects Python
    closures and the padding's values, which would break the graph).
    """
    mu = _MASKING_UTILS if _MASKING_UTILS is not None else _transformers()
    fn = mu.causal_mask_function if mask_function is None else mask_function
    config = kwargs.get("config")
    spec = None
    if (
        getattr(config, "model_type", None) in SPEC_MODEL_TYPES
        and type(kv_offset) is int
        and not torch.compiler.is_compiling()
        and not _building_masks_for_generate()
    ):
        rule = _read_rule(mu, fn)
        if rule is not None:
            spec = _spec(rule, attention_mask, batch_size, q_length, kv_length, q_offset, kv_offset)
    if spec is not None:
        return spec
    device = kwargs.get("device", attention_mask.device if attention_mask is not None else "cpu")
    dense: torch.Tensor = mu.sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=fn,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        use_vmap=bool(kwargs.get("use_vmap", False)),
        device=device,
    )
    return dense


# ---------------------------------------------------------------------------------------------
# the attention function

_REFUSED = {
    # kwarg: (the model feature, what the model would lose)
    "position_bias": ("a relative position bias (position_bias)", "a bias added to the scores"),
}


def _refuse(module: nn.Module, kwargs: dict[str, Any]) -> None:
    for name, (feature, meaning) in _REFUSED.items():
        value = kwargs.get(name)
        if value is None:
            continue
        shown = f"tensor {tuple(value.shape)}" if isinstance(value, torch.Tensor) else value
        raise AttentionInputError(
            f"attnkit.interop.hf_attention ({type(module).__name__})",
            name,
            f"this model uses {feature}, which attnkit does not compute yet; running without "
            f"it ({meaning}) would give a different model.",
            got=f"{name}={shown} from {type(module).__name__}",
            expected=f"{name}=None",
            fix='load this model with attn_implementation="eager" (or call '
            'model.set_attn_implementation("eager"))',
        )


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


def attention_arguments(
    module: nn.Module,
    attention_mask: MaskSpec | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """The keyword arguments :func:`attnkit.attention` (or :func:`attnkit.explain`) gets for
    one layer's call, as :func:`hf_attention` passes them: ``mask``, ``causal``, ``scale``,
    ``dropout_p``, ``softcap`` and ``sinks``. Arguments as for :func:`hf_attention`; a model
    feature attnkit does not compute raises :class:`~attnkit.AttentionInputError`.

    >>> import torch.nn as nn
    >>> attention_arguments(nn.Module(), None, is_causal=True, sliding_window=4)["causal"]
    True
    """
    _refuse(module, kwargs)
    mask, causal_flag = _mask_and_causal(module, attention_mask, is_causal, sliding_window)
    return {
        "mask": mask,
        "causal": causal_flag,
        "scale": scaling,
        "dropout_p": dropout,
        "softcap": kwargs.get("softcap"),
        "sinks": kwargs.get("s_aux"),
    }


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
        attention_mask: what :func:`hf_mask` returned (a spec, or a bool mask ``(B, 1, L,
            S)``, True = may attend), a mask the caller built (bool, or float added to the
            scores), or ``None`` (then ``is_causal``, else ``module.is_causal``, decides).
        **kwargs: what the layer passes by keyword, read by :func:`attention_arguments`:
            ``dropout`` (on the weights; models pass 0 outside training), ``scaling``
            (multiplies ``q @ k^T``; default ``1 / sqrt(D)``), ``is_causal``,
            ``sliding_window`` (used only with no mask: the mask holds the window otherwise),
            ``softcap`` (Gemma 2's logit soft-cap) and ``s_aux`` (gpt-oss's attention sinks,
            ``(H,)``), which go to :func:`attnkit.attention` as ``softcap`` and ``sinks``;
            ``output_attentions`` (else ``module.config.output_attentions``) asks for the
            weights. ``position_bias`` raises :class:`~attnkit.AttentionInputError`: attnkit
            does not compute it.

    Returns:
        ``(output (B, L, H, D) contiguous, weights (B, H, L, S) or None)``.
    """
    common = attention_arguments(module, attention_mask, **kwargs)
    want = kwargs.get("output_attentions")
    if want is None:
        want = getattr(getattr(module, "config", None), "output_attentions", False)
    weights = None
    if want:
        out, weights = attention(query, key, value, return_weights=True, **common)
    else:
        out = attention(query, key, value, **common)
    return out.transpose(1, 2).contiguous(), weights  # (B, L, H, D)
