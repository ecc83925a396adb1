"""Decisions remembered across calls: the fast path of :func:`attnkit.backends.choose`.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.

A decode step calls attention once per layer with the same sizes, the same mask and the same
flags, and so does every step after it: asking each backend again (its refusals, auto's rule,
its plan) costs more than a small call's kernel. So :func:`~attnkit.backends.choose` keeps the
decision it took, in a bounded cache (:data:`SIZE` entries, least recently used first out),
under a key made of everything a decision reads:

- the backend asked for (``"auto"`` or a name);
- q, k and v's shapes, strides, dtype and device, the CPU path (:mod:`attnkit.cpu`), and which
  of them needs a gradient (with ``torch.is_grad_enabled()``);
- ``dropout_p``, ``return_weights``, ``softcap`` and the sinks' dtype and whether they need a
  gradient;
- the mask spec's cache key (:meth:`~attnkit.masks.MaskSpec.key`: its rule and the values of
  its tensors). A spec that attnkit built itself for one forward (the one
  :func:`attnkit.interop.hf_mask` hands every layer, :mod:`attnkit.backends.owned`) is keyed
  by its identity and its tensors' versions instead, so that the layers after the first read
  no tensor to find it; a dense backend's materialised form of such a spec is made once too.

What is never cached: a call of :func:`attnkit.explain`, a call while ``torch.compile`` traces,
a mask tensor (its decision reads its values), a spec without a key. A decision taken because a
backend before it was above attnkit's memory limit is not kept either (the free memory changes),
and a kept decision whose L x S memory is not nothing is held to the limit again at every hit.
The cache is emptied when the registry changes (:func:`~attnkit.backends.register_backend`),
when the ``blocked`` settings change (:func:`~attnkit.backends.blocked.configure`) and with the
plans (:func:`~attnkit.backends.blocked.clear_plans`); :func:`clear` empties it.

Validation is not cached: every call is checked as before; a hit only skips asking the backends
the same question again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import torch

from attnkit.backends.blocked import config as blocked_config
from attnkit.backends.owned import owned
from attnkit.call import AttentionCall
from attnkit.masks import MaskSpec

__all__ = ["SIZE", "call_key", "clear", "find", "keep"]

#: decisions kept at most (each holds its spec and plan: a few small tensors)
SIZE = 256

#: key -> (the decision, the spec it was made for, kept alive so that ids in the key stay unique)
_CACHE: OrderedDict[Hashable, tuple[Any, MaskSpec | None]] = OrderedDict()
#: the ``blocked`` settings the cached decisions were made under
_CONFIG: list[object] = [blocked_config.CONFIG]


def clear() -> None:
    """Forget every kept decision."""
    _CACHE.clear()


def _spec_key(spec: MaskSpec) -> Hashable | None:
    if owned(spec):
        return ("owned", id(spec), *(t._version for t in spec.tensors()))
    return spec.key()


def call_key(call: AttentionCall, backend: str) -> Hashable | None:
    """The key of ``call``'s decision on ``backend``, or ``None`` where it is not cached."""
    if call.explaining or torch.compiler.is_compiling():
        return None
    if blocked_config.CONFIG is not _CONFIG[0]:  # settings changed (configure, a test's patch)
        _CACHE.clear()
        _CONFIG[0] = blocked_config.CONFIG
    spec = call.mask
    skey: Hashable = None
    if spec is not None:
        if spec.from_tensor:
            return None
        skey = _spec_key(spec)
        if skey is None:
            return None
    q, k, v, sinks = call.q, call.k, call.v, call.sinks
    return (
        backend, skey, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(),
        q.dtype, q.device, call.cpu_path, call.dropout_p, call.return_weights, call.softcap,
        q.requires_grad, k.requires_grad, v.requires_grad, torch.is_grad_enabled(),
        None if sinks is None else (sinks.dtype, sinks.requires_grad),
    )  # fmt: skip


def find(key: Hashable) -> Any:
    """The decision kept under ``key``, or ``None``."""
    hit = _CACHE.get(key)
    if hit is None:
        return None
    _CACHE.move_to_end(key)
    return hit[0]


def keep(key: Hashable, decision: Any, spec: MaskSpec | None) -> None:
    """Keep ``decision`` under ``key`` (with the spec its key names)."""
    _CACHE[key] = (decision, spec)
    while len(_CACHE) > SIZE:
        _CACHE.popitem(last=False)
