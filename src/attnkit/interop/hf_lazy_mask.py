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

One operation stays lazy: ``torch.cat`` of lazy masks along the keys (``dim=-1``), none of
them made yet, of one dtype and device and equal batch, head and query sizes (T5Gemma 2's
decoder joins its self-attention mask and its cross-attention mask so, for attention over its
own keys and the encoder's). Its result is a lazy mask of the concatenated shape whose spec is
:func:`~attnkit.masks.concat_keys` of the parts' specs, and whose recipe concatenates the
parts' dense masks (what the model's ``torch.cat`` computes). A ``torch.cat`` with anything
else (a dense tensor, such as DeepSeek-V4's compressor bias, another dim, ``out=``) makes the
dense masks first, as any other operation does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_map

from attnkit.backends import owned
from attnkit.interop.hf_rules import UNMASKED
from attnkit.masks import MaskSpec, concat_keys

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
        if func in _CATS:
            joined = _cat_keys(*args, **kwargs)
            if joined is not None:
                return joined
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


_CATS = frozenset({torch.cat, torch.concat, torch.concatenate})


def _cat_keys(
    tensors: object = (), dim: object = 0, *, axis: object = None, out: object = None
) -> LazyMask | None:
    """``torch.cat(tensors, dim=-1)`` of lazy masks not made yet, as a lazy mask whose spec
    is :func:`~attnkit.masks.concat_keys` of theirs; ``None`` (make the dense masks) for
    anything else."""
    dim = dim if axis is None else axis
    if out is not None or not isinstance(tensors, (list, tuple)) or len(tensors) < 2:
        return None
    parts = list(tensors)
    if not all(isinstance(p, LazyMask) and not p.made and p.dim() == 4 for p in parts):
        return None
    first = parts[0]
    if dim not in (-1, 3) or any(
        p.dtype != first.dtype or p.device != first.device or p.shape[:3] != first.shape[:3]
        for p in parts
    ):
        return None
    specs = [p.spec for p in parts]
    if any(s.from_tensor or s.selects_keys for s in specs):
        return None
    makes = [p._make for p in parts]
    spec, S = specs[0], parts[0].shape[3]
    for part, more in zip(specs[1:], parts[1:], strict=True):
        spec, S = concat_keys(spec, S, part, more.shape[3]), S + more.shape[3]
    if all(s is UNMASKED for s in specs):
        spec = UNMASKED
    elif all(owned.owned(s) or not s.tensors() for s in specs):
        owned.own(spec)  # built from attnkit's own copies, as the parts' specs are

    def make() -> torch.Tensor:  # the model's torch.cat of the parts' dense masks
        return torch.cat([m() for m in makes if m is not None], dim=-1)

    return LazyMask(spec, make, (*first.shape[:3], S), first.dtype, first.device)


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
