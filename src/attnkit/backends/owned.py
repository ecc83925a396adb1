"""Mask specs that attnkit built itself for one forward and hands every layer of it.

Dimension legend: B batch, L query length, S key length.

:func:`attnkit.interop.hf_mask` builds one spec per forward (``causal() & key_mask(keep)``
from the padding mask, on a copy of it that no one else holds) and every attention layer of
that forward gets it. Such a spec is *owned* (:func:`own`): the dispatcher finds its decision
by its identity and its tensors' versions (:mod:`attnkit.backends.memo`), and a dense backend's
materialised form of it is made once for all the layers (:func:`dense`), not once per layer.
A write through torch to its tensor bumps their version, and is seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable

import torch

from attnkit.masks import MaskSpec

__all__ = ["DENSE_BYTES", "dense", "own", "owned"]

#: the specs attnkit built and handed out itself (:func:`own`)
_OWNED: weakref.WeakSet[MaskSpec] = weakref.WeakSet()


def own(spec: MaskSpec) -> MaskSpec:
    """Mark ``spec`` as built by attnkit from tensors no one else holds (a copy made for it),
    so that its decisions are found by its identity and its tensors' versions; returns it."""
    _OWNED.add(spec)
    return spec


def owned(spec: MaskSpec) -> bool:
    """Whether ``spec`` was marked by :func:`own`."""
    return spec in _OWNED


#: an owned spec's materialised forms (dense backends), per (versions, L, S, device, dtype)
_DENSE: weakref.WeakKeyDictionary[MaskSpec, dict[Hashable, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)
#: the largest materialised mask kept with its spec (bytes): a decode step's are a few KiB
DENSE_BYTES = 1 << 20


def dense(spec: MaskSpec, L: int, S: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``spec.to_dense(L, S, device=device, dtype=dtype)``, made once for every layer of a
    forward where ``spec`` is owned (:func:`own`) and the mask is at most :data:`DENSE_BYTES`;
    else made anew. The tensor is shared: callers only read it."""
    if torch.compiler.is_compiling() or not owned(spec):  # (a traced read of the registry
        # would guard the graph on its size, and every spec freed would recompile it)
        return spec.to_dense(L, S, device=device, dtype=dtype)
    forms = _DENSE.setdefault(spec, {})
    key = (*(t._version for t in spec.tensors()), L, S, device, dtype)
    found = forms.get(key)
    if found is None:
        found = spec.to_dense(L, S, device=device, dtype=dtype)
        if found.numel() * found.element_size() <= DENSE_BYTES:
            forms.clear()  # (a spec is one forward's: its older forms are not asked again)
            forms[key] = found
    return found
