"""transformers' mask interface for ``attn_implementation="attnkit"``: :func:`hf_mask`.

Dimension legend: B batch, L query length, S key length.

transformers calls the mask function once per forward with the mask *rule* (its
``mask_function``: causal, sliding window, bidirectional ...), the 2-D padding mask and where
the queries and keys start (``q_offset``, ``kv_offset``). Where attnkit can prove the rule
(:mod:`attnkit.interop.hf_rules`), it returns a lazy mask
(:mod:`attnkit.interop.hf_lazy_mask`): a tensor without values that carries the attnkit spec
(``causal() & sliding_window(w) & key_mask(keep)``), so block-sparse backends skip the empty
blocks, and that becomes transformers' own dense mask ``(B, 1, L, S)`` the moment a model's
code operates on it. A rule it cannot prove is carried the same way as a mask function,
transformers' own ``mask_function`` under ``from_function`` (:mod:`attnkit.interop.hf_function`);
only what cannot be evaluated so (a tensor query offset, ``generate``'s ahead-built masks,
``torch.compile`` tracing, a function that fails on index tensors) gets that dense mask at once:
a rule is never dropped or guessed (eager's float form for the models whose code adds float
biases to it). No model type is singled out for specs. A model whose attention layers do not call
transformers' attention interface is refused here, the one place attnkit sees it. This module
also checks the installed transformers for :func:`attnkit.interop.register_hf`.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any

import torch
from torch import nn

from attnkit.backends import owned
from attnkit.errors import AttentionInputError
from attnkit.interop.hf_function import function_spec
from attnkit.interop.hf_lazy_mask import LazyMask
from attnkit.interop.hf_rules import UNMASKED, Reading, rule_spec
from attnkit.masks import MaskSpec

__all__ = [
    "FLOAT_MASK_MODEL_TYPES",
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


def _building_masks_for_generate() -> bool:
    """Whether transformers' ``create_masks_for_generate`` asked for ``generate``: it builds the
    masks of a compileable (static) cache ahead of the forward and hands them to the model
    (which may be compiled) as its ``attention_mask``. A model whose own ``forward`` calls
    ``create_masks_for_generate`` to build its masks (Gemma 3's multimodal model) is not
    ``generate`` asking: it gets lazy masks as from ``create_causal_mask``."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_code.co_name == "create_masks_for_generate":
            return not _called_from_forward(frame.f_back)
        frame = frame.f_back
    return False


def _called_from_forward(frame: FrameType | None) -> bool:
    """Whether a model's ``forward`` is the nearest caller (through decorators' wrappers, at
    most 3 frames up) before a ``create_masks_for_generate`` method or ``generate``'s
    ``prepare_inputs_for_generation``."""
    for _ in range(3):
        if frame is None:
            return False
        name = frame.f_code.co_name
        if name == "forward":
            return True
        if name in ("create_masks_for_generate", "prepare_inputs_for_generation"):
            return False
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


def _read_spec(mu: ModuleType, common: dict[str, Any]) -> MaskSpec | None:
    """The spec of the mask ``sdpa_mask(**common)`` would make: the rule read from
    transformers' mask function where it is proven, else that function itself as a function
    mask; ``None`` for a tensor key offset and for the masks ``generate`` builds ahead."""
    kv_offset = common["kv_offset"]
    if type(kv_offset) is not int or _building_masks_for_generate():
        return None
    fn, padding = common["mask_function"], common["attention_mask"]
    sizes = (common["batch_size"], common["q_length"], common["kv_length"])
    at = Reading(*sizes, common["q_offset"], kv_offset)
    spec = rule_spec(mu, fn, padding, at)
    if spec is None:  # not proven: transformers' own function, as sdpa_mask calls it
        spec = function_spec(fn, padding, at, bool(common["use_vmap"]), common["device"])
    return spec


def hf_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' mask interface: a :class:`~attnkit.interop.hf_lazy_mask.LazyMask`
    carrying the attnkit spec where the rule is proven, else transformers' function as a
    function mask, else transformers' dense mask.

    Called by transformers' ``create_causal_mask`` / ``create_sliding_window_causal_mask`` /
    ``create_chunked_causal_mask`` / ``create_bidirectional_mask`` with the keyword arguments
    of its ``sdpa_mask``: the queries are positions ``q_offset .. q_offset + L - 1`` and the
    keys ``kv_offset .. kv_offset + S - 1``; ``attention_mask`` is the 2-D padding mask
    ``(B, >= kv_offset + S)``, True = a real token. Where every part of ``mask_function`` is
    recognised (:func:`attnkit.interop.hf_rules.rule_spec`: causal, windows, chunks, padding,
    packed sequences, image-token blocks, bidirectional, and their ``and_masks`` /
    ``or_masks``), the result is a lazy mask: a tensor of the dense mask's shape, dtype and
    device that carries the spec, which attnkit's attention function reads; any torch
    operation on it makes the dense mask first, with transformers' code, so a model that edits
    its mask computes what ``sdpa`` would. A rule not recognised (a model's own function,
    offsets that do not line up, Gemma 3's window over a longer image block) gets a lazy mask
    too, whose spec is ``from_function`` over ``mask_function``, evaluated as ``sdpa_mask``
    evaluates it, ``& key_mask`` of the padding
    (:func:`attnkit.interop.hf_function.function_spec`). ``sdpa_mask``'s dense bool mask
    ``(B, 1, L, S)`` comes at once for a tensor query offset (a compiled static cache), a
    function that cannot be evaluated on index tensors, the masks ``generate`` builds ahead for
    a compileable cache (the model's code takes only plain tensors there) and calls traced by
    ``torch.compile`` (reading the rule inspects closures and the padding's values). The
    models of :data:`FLOAT_MASK_MODEL_TYPES` get ``eager_mask``'s float form as the dense
    mask (0 = may attend, the dtype's minimum = blocked), as their code needs.

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
    model_type = getattr(kwargs.get("config"), "model_type", None)
    compiling = torch.compiler.is_compiling()
    if not compiling:
        _refuse_models_outside_the_interface()
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
    floating = model_type in FLOAT_MASK_MODEL_TYPES
    dtype = kwargs.get("dtype", torch.float32) if floating else torch.bool

    def dense() -> torch.Tensor:
        if floating:
            return mu.eager_mask(**common, dtype=dtype)  # type: ignore[no-any-return]
        return mu.sdpa_mask(**common, allow_is_causal_skip=False)  # type: ignore[no-any-return]

    spec = None if compiling else _read_spec(mu, common)
    if spec is None:
        return dense()
    if spec.tensors():
        # every layer of this forward gets this one spec: the dispatcher finds its decision
        # by its identity from the second layer on, without reading the tables again
        owned.own(spec)
    shape = (batch_size, 1, q_length, kv_length)
    return LazyMask(spec, dense, shape, dtype, torch.device(device))
