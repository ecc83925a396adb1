"""The keyword arguments transformers declares for a model's ``forward(**kwargs)``, read from
the installed transformers itself.

What a model's ``forward`` takes by ``**kwargs`` it hands on to its layers and, through them,
to the attention function (:func:`attnkit.interop.hf_attention.hf_attention`), and to its loss
function. transformers declares those names:

- as TypedDicts (:data:`TYPED_DICTS`): ``TransformersKwargs`` (``transformers.utils.generic``:
  outputs, loss, packed sequences), ``FlashAttentionKwargs``
  (``transformers.modeling_flash_attention_utils``: flash-attention's varlen arguments) and
  ``LossKwargs`` where a version has one (transformers 4.4x had; 5.24 has none);
- as the optional parameters of its loss functions (``transformers.loss.loss_utils
  .LOSS_MAPPING``: ``ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=None,
  ignore_index=-100, shift_labels=None, **kwargs)`` ...): the model passes the required ones
  itself, the optional ones come through the same ``**kwargs``.

:mod:`attnkit.interop.hf_kwargs` classifies a name its table lacks by these declarations: a loss
argument is harmless, any other is refused with the declaration that lists it. Nothing here
imports transformers when attnkit is imported: :func:`declared` reads it once transformers is
imported (``register_hf`` reads it), and is empty before.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = [
    "LOSS_FUNCTIONS",
    "TYPED_DICTS",
    "Declarations",
    "declared",
    "optional_parameters",
    "read",
    "typed_dict_keys",
]

Kind = Literal["forward", "loss", "attention"]

#: the TypedDicts read: (module, class name, what their names are). ``forward``: the model's
#: forward arguments (outputs, loss, packed sequences: each one needs the table);
#: ``loss``: the loss function's arguments; ``attention``: flash-attention's arguments
TYPED_DICTS: tuple[tuple[str, str, Kind], ...] = (
    ("transformers.utils.generic", "TransformersKwargs", "forward"),
    ("transformers.utils.generic", "LossKwargs", "loss"),
    ("transformers.modeling_flash_attention_utils", "FlashAttentionKwargs", "attention"),
)

#: the loss functions read: (module, the mapping of loss types to loss functions)
LOSS_FUNCTIONS = ("transformers.loss.loss_utils", "LOSS_MAPPING")


@dataclass(frozen=True)
class Declarations:
    """What the installed transformers declares: each declaration's names and kind.

    >>> d = Declarations({"LossKwargs": frozenset({"shift_labels"})}, {"LossKwargs": "loss"})
    >>> d.where("shift_labels"), d.is_loss("shift_labels"), d.where("indices")
    (['LossKwargs'], True, [])
    """

    #: declaration (``TransformersKwargs``, ``FlashAttentionKwargs``, ``ForCausalLMLoss`` ...)
    #: -> the names it lists
    names: Mapping[str, frozenset[str]] = field(default_factory=dict)
    #: declaration -> what its names are
    kinds: Mapping[str, Kind] = field(default_factory=dict)

    def where(self, name: str) -> list[str]:
        """The declarations that list ``name``, in the order they were read."""
        return [d for d, names in self.names.items() if name in names]

    def is_loss(self, name: str) -> bool:
        """Whether ``name`` is declared as a loss argument and not as flash-attention's."""
        kinds = {self.kinds[d] for d in self.where(name)}
        return "loss" in kinds and "attention" not in kinds


def typed_dict_keys(cls: object) -> frozenset[str]:
    """The keys of a TypedDict class, its bases' too (empty for anything else).

    >>> from typing import TypedDict
    >>> class A(TypedDict, total=False):
    ...     a: int
    >>> class B(A):
    ...     b: str
    >>> sorted(typed_dict_keys(B)), typed_dict_keys(dict)
    (['a', 'b'], frozenset())
    """
    if not (isinstance(cls, type) and issubclass(cls, dict) and hasattr(cls, "__total__")):
        return frozenset()  # not a TypedDict (typing's or typing_extensions')
    keys = getattr(cls, "__required_keys__", frozenset()) | getattr(
        cls, "__optional_keys__", frozenset()
    )
    return frozenset(keys) or frozenset(getattr(cls, "__annotations__", {}))


def optional_parameters(fn: Callable[..., Any]) -> frozenset[str]:
    """The parameters of ``fn`` that have a default (what a caller may pass by keyword).

    >>> def loss(logits, labels, ignore_index=-100, *, shift_labels=None, **kwargs): ...
    >>> sorted(optional_parameters(loss))
    ['ignore_index', 'shift_labels']
    """
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read
        return frozenset()
    return frozenset(
        p.name
        for p in parameters
        if p.default is not inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def read() -> Declarations:
    """Read :data:`TYPED_DICTS` and :data:`LOSS_FUNCTIONS` from the installed transformers
    (imports them); a module or class the version lacks is left out."""
    names: dict[str, frozenset[str]] = {}
    kinds: dict[str, Kind] = {}
    for module, cls, kind in TYPED_DICTS:
        keys = typed_dict_keys(getattr(_module(module), cls, None))
        if keys:
            names[cls], kinds[cls] = keys, kind
    mapping = getattr(_module(LOSS_FUNCTIONS[0]), LOSS_FUNCTIONS[1], None)
    functions = mapping.values() if isinstance(mapping, Mapping) else ()
    for fn in functions:
        title = getattr(fn, "__name__", type(fn).__name__)
        if params := optional_parameters(fn):
            names[title], kinds[title] = names.get(title, frozenset()) | params, "loss"
    return Declarations(names, kinds)


_read: list[Declarations] = []  # the one reading, once done


def declared() -> Declarations:
    """:func:`read`, once: empty while transformers is not imported (nothing is imported
    here), and while torch.compile traces before the first reading (``register_hf`` reads
    it before any model runs)."""
    if not _read:
        if "transformers" not in sys.modules or torch.compiler.is_compiling():
            return Declarations()
        _read.append(read())
    return _read[0]
