"""attnkit as the attention transformers picks when a model is loaded without
``attn_implementation``: :func:`use_by_default`.

transformers resolves ``attn_implementation=None`` in
``PreTrainedModel.get_correct_attn_implementation``: ``"sdpa"`` where the model supports it
(``_supports_sdpa``), else ``"eager"``. :func:`use_by_default` wraps that method so that the
default becomes attnkit's registered name where it would have been ``"sdpa"`` (and, if asked,
``"eager"``) and the model's attention layers call transformers' ``AttentionInterface``
(the check ``set_attn_implementation`` uses; a model whose layers do not would never run
attnkit, and its mask function refuses it). A name the caller gives (``"eager"``, ``"sdpa"``,
...) is never changed, and neither is a model that falls back to eager unless ``instead_of``
names it. Nothing else in transformers is touched.

    with attnkit.interop.use_by_default():
        model = AutoModelForCausalLM.from_pretrained(path)     # runs on attnkit

It also works as a plain call, undone by ``.restore()``. Models built while it is in effect
keep attnkit after it ends (the name is written into their config, as ``"sdpa"`` would be).
"""

from __future__ import annotations

import functools
import importlib
from types import TracebackType
from typing import Any

from attnkit.errors import AttentionInputError
from attnkit.interop.hf_attention import register_hf

__all__ = ["DefaultAttention", "use_by_default"]

WHERE = "attnkit.interop.use_by_default"


class DefaultAttention:
    """The handle :func:`use_by_default` returns: a context manager, or ``.restore()``.

    ``name`` is the implementation models get by default while it is in effect, in place of
    the defaults in ``instead_of``; ``applied`` counts the models (and sub-models) that got it.
    """

    def __init__(self, name: str, instead_of: frozenset[str]) -> None:
        self.name = name
        self.instead_of = instead_of
        modeling_utils = importlib.import_module("transformers.modeling_utils")
        self._model_class: Any = modeling_utils.PreTrainedModel
        self._previous = self._model_class.__dict__["get_correct_attn_implementation"]
        self._active = True
        self.applied = 0

    @property
    def active(self) -> bool:
        """Whether models loaded without ``attn_implementation`` get :attr:`name` now."""
        return self._active

    def restore(self) -> None:
        """Put transformers' previous default back. Handles end in the reverse order of their
        making (as nested ``with`` blocks do); ending one out of order raises."""
        if not self._active:
            return
        current = self._model_class.__dict__["get_correct_attn_implementation"]
        if getattr(current, "_attnkit_default", None) is not self:
            raise AttentionInputError(
                WHERE,
                "restore",
                "another use_by_default() made after this one is still in effect.",
                got=f"this handle's name={self.name!r}; the newest handle's name="
                f"{getattr(getattr(current, '_attnkit_default', None), 'name', None)!r}",
                expected="handles restored newest first",
                fix="restore the newer handle first, or use nested `with use_by_default():` blocks",
            )
        self._model_class.get_correct_attn_implementation = self._previous
        self._active = False

    def __enter__(self) -> DefaultAttention:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.restore()


def _prefers(
    model: Any, handle: DefaultAttention, requested: str | None, previous: Any, init: bool
) -> str:
    """``handle.name`` where transformers' default would be one of ``handle.instead_of`` and
    the layers call the interface; transformers' own answer everywhere else."""
    chosen: str = previous(model, requested, init)
    if (
        requested is None
        and chosen in handle.instead_of
        and type(model)._can_set_attn_implementation()
    ):
        handle.applied += 1
        return handle.name
    return chosen


def use_by_default(
    name: str = "attnkit", *, instead_of: tuple[str, ...] = ("sdpa",)
) -> DefaultAttention:
    """Make transformers models loaded without ``attn_implementation`` run on attnkit.

    Registers attnkit under ``name`` (:func:`attnkit.interop.register_hf`), then makes ``name``
    transformers' default wherever the default would be one of ``instead_of`` and the model's
    attention layers call ``AttentionInterface``. With the default ``("sdpa",)``, models that
    transformers runs on ``"eager"`` because sdpa cannot compute them (Gemma 2's soft-cap,
    gpt-oss's sinks) stay on eager; ``instead_of=("sdpa", "eager")`` gives them attnkit too,
    which computes those two, and refuses with an error, naming the fix, a feature it does not
    compute (T5's position bias, ...). Models whose layers skip the interface (Falcon, Bloom,
    MPT, ...) keep transformers' choice, and a name the caller passes is always kept. In effect
    from the call until the returned handle's ``restore()`` or the end of its ``with`` block.
    Needs ``transformers>=5.4,<6``.

    Raises:
        AttentionInputError: ``name`` is not a plain name or is taken (as for ``register_hf``);
            ``instead_of`` is empty or names something other than ``"sdpa"`` and ``"eager"``.

    >>> import attnkit.interop
    >>> with attnkit.interop.use_by_default() as default:
    ...     default.name
    'attnkit'
    """
    names = tuple(instead_of) if isinstance(instead_of, tuple | list) else ()
    if not names or not all(n in ("sdpa", "eager") for n in names):
        raise AttentionInputError(
            WHERE,
            "instead_of",
            "attnkit can stand in only for transformers' two defaults, sdpa and eager.",
            got=f"instead_of={instead_of!r}",
            expected='a non-empty tuple of "sdpa" and "eager"',
            fix='use_by_default() (sdpa only) or use_by_default(instead_of=("sdpa", "eager"))',
        )
    register_hf(name)
    handle = DefaultAttention(name, frozenset(names))
    previous = handle._previous

    @functools.wraps(previous)
    def get_correct_attn_implementation(
        self: Any, requested_attention: str | None, is_init_check: bool = False
    ) -> str:
        return _prefers(self, handle, requested_attention, previous, is_init_check)

    get_correct_attn_implementation._attnkit_default = handle  # type: ignore[attr-defined]
    handle._model_class.get_correct_attn_implementation = get_correct_attn_implementation
    return handle
