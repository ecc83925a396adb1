"""The mask attnkit's mask interface hands a transformers model: :class:`LazyMask`.

Dimension legend: B batch, L query length, S key length.

A :class:`LazyMask` is a ``torch.Tensor`` of the shape, dtype and device of the dense mask
transformers' ``sdpa`` (or ``eager``) path would build, ``(B, 1, L, S)``, that holds no values:
it carries the attnkit spec of the same rule (:attr:`LazyMask.spec`) and a recipe for the dense
mask. attnkit's attention function reads the spec. Any torch operation on it (a model that
slices the mask, adds a bias, concatenates it, prints it) first makes transformers' dense mask
with transformers' own code for the same arguments, once, and runs on that; reading its shape,
dtype, device or number of dimensions does not. So a model that hands the mask on untouched
runs attnkit on the spec, and a model that edits it gets exactly what ``sdpa``/``eager`` would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_map

from attnkit.masks import MaskSpec

__all__ = ["LazyMask", "spec_of"]

_Tensor = torch.Tensor


class LazyMask(torch.Tensor):
    """A dense mask not made yet: its attnkit :attr:`spec` and a recipe for its values.

    >>> from attnkit.masks import causal
    >>> m = LazyMask(causal(), lambda: torch.ones(2, 3, dtype=torch.bool).tril()[None, None],
    ...              (1, 1, 2, 3), torch.bool, torch.device("cpu"))
    >>> m.shape, m.made
    (torch.Size([1, 1, 2, 3]), False)
    >>> m[0, 0].sum().item(), m.made                # any operation makes it
    (3, True)
    """

    spec: MaskSpec
    _make: Callable[[], torch.Tensor] | None
    _dense: torch.Tensor | None
    _seen_version: int

    #: what may be read without the values
    _METADATA: ClassVar[frozenset[Any]] = frozenset(
        {
            _Tensor.shape.__get__,  # type: ignore[attr-defined]
            _Tensor.dtype.__get__,  # type: ignore[attr-defined]
            _Tensor.device.__get__,
            _Tensor.ndim.__get__,  # type: ignore[attr-defined]
            _Tensor.layout.__get__,  # type: ignore[attr-defined]
            _Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
            _Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
            _Tensor.is_floating_point,
            _Tensor.dim,
            _Tensor.size,
            _Tensor.__len__,
        }
    )

    @staticmethod
    def __new__(
        cls,
        spec: MaskSpec,
        make: Callable[[], torch.Tensor],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> LazyMask:
        mask: LazyMask = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=device, requires_grad=False
        )
        mask.spec = spec
        mask._make = make
        mask._dense = None
        mask._seen_version = -1
        return mask

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    @property
    def made(self) -> bool:
        """Whether the dense values were made (some operation needed them)."""
        return self._dense is not None

    def dense(self) -> torch.Tensor:
        """transformers' dense mask for the same arguments (made on the first call)."""
        if self._dense is None:
            assert self._make is not None
            with torch._C.DisableTorchFunctionSubclass():
                self._dense = self._make()
                self._seen_version = self._dense._version
            self._make = None  # frees what the recipe held
        return self._dense

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return f"LazyMask({self.spec!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in cls._METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map(_values, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        args, kwargs = tree_map(_values, (args, kwargs or {}))
        return func(*args, **kwargs)


def _values(x: object) -> object:
    return x.dense() if isinstance(x, LazyMask) else x


def spec_of(mask: object) -> object:
    """What attention runs with for ``mask``: a :class:`LazyMask`'s spec while its values were
    never written (made and only read, or never made), its dense values once something wrote
    to them in place; anything else as it is."""
    if not isinstance(mask, LazyMask):
        return mask
    dense = mask._dense
    if dense is None or dense._version == mask._seen_version:
        return mask.spec
    return dense
