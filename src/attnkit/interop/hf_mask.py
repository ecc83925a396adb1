"""transformers' mask interface for ``attn_implementation="attnkit"``: :func:`hf_mask`.

Dimension legend: B batch, L query length, S key length.

transformers calls the mask function once per forward with the mask *rule* (its
``mask_function``: causal, sliding window, bidirectional ...), the 2-D padding mask and where
the queries and keys start (``q_offset``, ``kv_offset``). Where attnkit can prove the rule, it
returns an attnkit mask spec (``causal() & sliding_window(w) & key_mask(keep)``) and
block-sparse backends skip the empty blocks; anywhere else it returns transformers' own dense
mask ``(B, 1, L, S)``: a causal or window rule is never dropped or guessed (eager's float form
for the models whose code adds float biases to it). A model whose attention layers do not call
transformers' attention interface is refused here, the one place attnkit sees it. This module
also checks the installed transformers for :func:`attnkit.interop.register_hf`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType, ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnkit.backends import owned
from attnkit.errors import AttentionInputError
from attnkit.masks import MaskSpec, causal, key_mask, sliding_window, unmasked

__all__ = [
    "FLOAT_MASK_MODEL_TYPES",
    "SPEC_MODEL_TYPES",
    "SUPPORTED",
    "UNMASKED",
    "hf_mask",
    "load_masking_utils",
]

WHERE = "attnkit.interop.register_hf"
WHERE_MASK = "attnkit.interop.hf_mask"
#: the transformers versions whose mask and attention interfaces attnkit uses (the `hf` extra)
SUPPORTED = "transformers>=5.4,<6"
_LOWEST = (5, 4)  # 5.4 gave the mask interface q_length / q_offset (before: cache_position)
INSTALL = "pip install 'attnkit[hf]'"

#: ``config.model_type`` of the models whose code hands the mask from the mask function to
#: the attention function untouched (verified against ``eager`` in
#: ``tests/interop/test_hf_attention.py``); other models get transformers' dense mask.
SPEC_MODEL_TYPES = frozenset({"bert", "llama", "mistral", "qwen2"})

#: ``config.model_type`` of the models whose code extends the mask with float biases of its own
#: in eager's form: they get eager's float mask (0 = may attend, the dtype's minimum =
#: blocked) instead of the bool one (DeepSeek-V4 appends its compressor's ``block_bias`` with
#: ``.to(attention_mask.dtype)``, which would turn a bool mask's blocked ``-inf`` into True).
FLOAT_MASK_MODEL_TYPES = frozenset({"deepseek_v4"})

#: ``transformers.masking_utils`` once :func:`register_hf` has checked it (read by
#: :func:`hf_mask`, which must not import while ``torch.compile`` traces it)
_MASKING_UTILS: ModuleType | None = None


def load_masking_utils() -> ModuleType:
    """``transformers.masking_utils``, after checking that transformers is there and recent
    (then :func:`hf_mask` reads it without importing, as it must while ``torch.compile``
    traces it)."""
    global _MASKING_UTILS
    _MASKING_UTILS = _transformers()
    return _MASKING_UTILS


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
    held = False
    if keep is not None and not bool(keep.all()):  # a copy of its own: no one else writes it
        parts.append(key_mask(keep.clone()))
        held = True
    if not parts:
        return UNMASKED
    spec = parts[0]
    for part in parts[1:]:
        spec = spec & part
    # every layer of this forward gets this one spec: the dispatcher finds its decision by its
    # identity from the second layer on, without reading the padding again (backends.owned)
    return owned.own(spec) if held else spec


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


def _calling_model() -> nn.Module | None:
    """The transformers model whose code asked for the mask (the nearest ``self`` up the
    stack that is a ``PreTrainedModel``), or ``None``."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return None
        me = frame.f_locals.get("self")
        if isinstance(me, nn.Module) and hasattr(me, "config") and hasattr(me, "_supports_sdpa"):
            return me
        frame = frame.f_back
    return None


_SKIPS: dict[type, bool] = {}  # _skips_the_interface per model class (it reads source files)
_ATTENTION_CLASS = re.compile(r"^class \w*Attention\w*\(nn\.Module\):", re.MULTILINE)


def _skips_the_interface(cls: type) -> bool:
    """Whether the source of ``cls`` (or of the classes it derives from) defines attention
    layers and never calls ``ALL_ATTENTION_FUNCTIONS``: transformers' own test
    (``PreTrainedModel._can_set_attn_implementation``), except that a class whose source cannot
    be read (a notebook's) counts as calling it."""
    for klass in cls.__mro__:
        if klass.__module__.startswith(("torch.", "builtins")) or klass.__name__ in (
            "PreTrainedModel",
            "GenerationMixin",
        ):
            continue
        try:
            code = inspect.getsource(sys.modules[klass.__module__])
        except (KeyError, OSError, TypeError):
            return False
        if "ALL_ATTENTION_FUNCTIONS" in code:
            return False
        if _ATTENTION_CLASS.search(code):
            return True
    return False


def _refuse_models_outside_the_interface() -> None:
    """A model whose attention layers do not call transformers' ``AttentionInterface`` still
    asks the mask interface for its masks; it would then run its own attention on attnkit's
    masks (which its code reads as eager's float masks) and never run attnkit."""
    model = _calling_model()
    if model is None:
        return
    cls = type(model)
    if cls not in _SKIPS:
        _SKIPS[cls] = _skips_the_interface(cls)
    if not _SKIPS[cls]:
        return
    raise AttentionInputError(
        f"{WHERE_MASK} ({cls.__name__})",
        "attn_implementation",
        f"{cls.__name__}'s attention layers do not call transformers' AttentionInterface, so "
        'attn_implementation="attnkit" would not run attnkit: its own attention code would '
        "read attnkit's masks (it expects eager's) and give a different model.",
        got=f"model_type {getattr(model.config, 'model_type', None)!r}, "
        f"attn_implementation={getattr(model.config, '_attn_implementation', None)!r}",
        expected="a model whose attention layers call ALL_ATTENTION_FUNCTIONS.get_interface",
        fix='load this model with attn_implementation="eager" (or "sdpa" where it supports it)',
    )


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
    closures and the padding's values, which would break the graph). The models of
    :data:`FLOAT_MASK_MODEL_TYPES` get ``eager_mask``'s float form instead (0 = may attend,
    the dtype's minimum = blocked), as their code needs.

    Raises:
        AttentionInputError: the model asking (the nearest ``PreTrainedModel`` up the stack)
            does not run its attention through transformers' ``AttentionInterface`` (Bloom,
            TrOCR, BigBird, ...: its source defines attention layers and never calls the
            interface, as transformers' own ``_can_set_attn_implementation`` checks),
            so attnkit would never run and its own attention would read attnkit's masks.
            Not checked while ``torch.compile`` traces (it reads the call stack).
    """
    mu = _MASKING_UTILS if _MASKING_UTILS is not None else _transformers()
    fn = mu.causal_mask_function if mask_function is None else mask_function
    config = kwargs.get("config")
    model_type = getattr(config, "model_type", None)
    if not torch.compiler.is_compiling():
        _refuse_models_outside_the_interface()
    spec = None
    if (
        model_type in SPEC_MODEL_TYPES
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
    common = {
        "batch_size": batch_size,
        "q_length": q_length,
        "kv_length": kv_length,
        "q_offset": q_offset,
        "kv_offset": kv_offset,
        "mask_function": fn,
        "attention_mask": attention_mask,
        "allow_is_bidirectional_skip": False,
        "use_vmap": bool(kwargs.get("use_vmap", False)),
        "device": device,
    }
    dense: torch.Tensor
    if model_type in FLOAT_MASK_MODEL_TYPES:
        dense = mu.eager_mask(**common, dtype=kwargs.get("dtype", torch.float32))
    else:
        dense = mu.sdpa_mask(**common, allow_is_causal_skip=False)
    return dense
