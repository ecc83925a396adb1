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
- ``dropout_p``, ``return_weights``, ``softcap`` and the sinks' shape, dtype and whether they
  need a gradient;
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

Validation is not cached by :func:`find`: every call is checked as before; a hit only skips
asking the backends the same question again.

**Calls run directly.** One level further, for the calls a decode step makes (eager, on the
CPU, no gradient, no weights, no dropout, no soft-cap, no sinks, no mask tensor):
:func:`attnkit.attention` keeps, under the call's *signature* (:func:`direct_key`: q, k and v's
shapes, dtypes and k and v's strides, the mask spec's key as above, ``causal``, ``scale``, the
backend asked for and the CPU path setting), the function its backend's
:meth:`~attnkit.backends.Backend.direct` returned for the decision it took: the plan's kernel,
called on the tensors alone. A later call with the same signature runs that function and
nothing else. That skips the checks too, which is exact: every check of
:mod:`attnkit.validate` and :mod:`attnkit.mask_checks` reads only what the signature holds
(types, ranks, sizes, dtypes, devices, the flags and numbers, the spec's sizes), so a call with
a signature that passed them passes them again. The values are still read: the function
returns ``None`` where the kernel saw NaN or inf, and the call then takes the whole path (the
non-finite rule, :mod:`attnkit.backends.nonfinite`). Only a backend that offers such a function
is kept: the blocked backend's decode kernel (it checks the values itself), and SDPA where
torch gets q, k and v as they are and no mask tensor (no mask, causal, a spec that allows every
pair: an encoder's layers, a short prefill), after one sum of each of q, k and v; a call that
needs a materialised mask, repeated K/V or float32 copies takes the whole path every time.
:func:`run_direct` is that lookup and run; :func:`attnkit.attention` starts with it, and so does
transformers' attention interface (:func:`attnkit.interop.hf_attention`) for a call whose
keywords leave it ``attention(q, k, v, mask=spec, scale=scaling)``, so that a decode step's
layers skip the keyword table and the call's arguments too. :func:`clear` empties both caches.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch

from attnkit import cpu
from attnkit.backends.blocked import config as blocked_config
from attnkit.backends.owned import owned
from attnkit.call import AttentionCall
from attnkit.inspect import tracing
from attnkit.masks import MaskSpec

__all__ = [
    "SIZE", "Direct", "call_key", "clear", "direct_key", "find", "keep", "keep_direct",
    "run_direct",
]  # fmt: skip

#: a call run directly: ``(q, k, v) -> out``, or ``None`` where the whole path must run it
Direct = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], "torch.Tensor | None"]

#: decisions kept at most (each holds its spec and plan: a few small tensors)
SIZE = 256

#: key -> (the decision, the spec it was made for, kept alive so that ids in the key stay unique)
_CACHE: OrderedDict[Hashable, tuple[Any, MaskSpec | None]] = OrderedDict()
#: the ``blocked`` settings the cached decisions were made under
_CONFIG: list[object] = [blocked_config.CONFIG]


#: signature -> (the direct run, the mask the signature names, kept alive for its id)
DIRECT: dict[Hashable, tuple[Direct, MaskSpec | None]] = {}


def clear() -> None:
    """Forget every kept decision and direct run."""
    _CACHE.clear()
    DIRECT.clear()


def _settings_seen() -> None:
    if blocked_config.CONFIG is not _CONFIG[0]:  # settings changed (configure, a test's patch)
        clear()
        _CONFIG[0] = blocked_config.CONFIG


def _spec_key(spec: MaskSpec) -> Hashable | None:
    if owned(spec):
        return ("owned", id(spec), *[t._version for t in spec.tensors()])
    return spec.key()


def call_key(call: AttentionCall, backend: str) -> Hashable | None:
    """The key of ``call``'s decision on ``backend``, or ``None`` where it is not cached."""
    if call.explaining or torch.compiler.is_compiling():
        return None
    _settings_seen()
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
        None if sinks is None else (sinks.shape, sinks.dtype, sinks.requires_grad),
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


def direct_key(
    q: Any, k: Any, v: Any, mask: Any, causal: Any, scale: Any, backend: Any
) -> Hashable | None:
    """The signature of a call of :func:`attnkit.attention` that may run directly (see the
    module docstring; the caller has checked that it asks for no weights, dropout, soft-cap
    or sinks), or ``None``. Read before any check, so it takes anything: what is not plainly
    the tensors and flags of an eager CPU call without gradients gets ``None``."""
    if tracing.ANY_OPEN or torch.compiler.is_compiling():
        return None
    try:
        if not (q.is_cpu and k.is_cpu and v.is_cpu) or type(causal) is not bool:
            return None
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return None
        dtype = q.dtype
        path = None if dtype is torch.float32 else os.environ.get(cpu.ENV)
        skey: Hashable = None
        if mask is not None:
            if not isinstance(mask, MaskSpec) or mask.from_tensor:
                return None
            skey = _spec_key(mask)
            if skey is None:
                return None
        _settings_seen()
        return (
            backend, skey, causal, scale, q.shape, k.shape, v.shape, dtype, k.dtype, v.dtype,
            k.stride(), v.stride(), path,
        )  # fmt: skip
    except (AttributeError, TypeError):  # not tensors, or an unhashable argument: the checks
        return None  # will say what is wrong


def run_direct(
    q: Any, k: Any, v: Any, mask: Any, causal: Any, scale: Any, backend: Any
) -> tuple[torch.Tensor | None, Hashable | None]:
    """``(out, key)``: the output of a call of :func:`attnkit.attention` with these arguments
    (and no weights, dropout, soft-cap or sinks: the caller checks that) run directly, where one
    with its signature was kept (:func:`keep_direct`), else ``None`` (none was, or the kernel
    saw NaN or inf: the caller then takes the whole path); and the signature
    (:func:`direct_key`), for the caller that keeps the whole path's run under it."""
    key = direct_key(q, k, v, mask, causal, scale, backend)
    found = DIRECT.get(key) if key is not None else None
    return (None if found is None else found[0](q, k, v)), key


def keep_direct(key: Hashable, choice: Any, mask: MaskSpec | None) -> None:
    """Keep the direct run of ``choice`` (a :class:`~attnkit.backends.Choice` that ran a call
    whose signature is ``key``), where its backend offers one; ``mask`` is the call's mask
    argument, held so that the ids in the key stay unique."""
    d = choice.decision
    if choice.fallback or d.memory is not None:  # (held to the memory limit at every call)
        return
    run = choice.backend.direct(choice.call, d.plan)
    if run is None:
        return
    if len(DIRECT) >= SIZE:
        del DIRECT[next(iter(DIRECT))]  # the oldest first
    DIRECT[key] = (run, mask)
