"""The backends and the dispatcher: which code computes one attention call.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.

The path of one call, e.g. ``attnkit.attention(q, k, v, mask=masks.causal() &
masks.sliding_window(256))``:

1. :func:`attnkit.validate.make_call` validates the arguments and builds one frozen
   :class:`~attnkit.AttentionCall`; :func:`attnkit.masks.as_spec` folds the ``causal`` flag and
   the mask into one spec there, the only place they combine.
2. :func:`choose` picks the backend: a named one if its ``check`` passes (else an error, never
   a fallback), or for ``"auto"`` the first backend, by descending priority on the call's
   device (:func:`auto_order`), whose ``rule`` fires and whose ``check`` passes. On CPU the
   order is ``blocked > sdpa > math`` and a spec on a large problem goes to ``blocked``; on
   CUDA it is ``flex > sdpa > blocked > math``: a spec goes to ``flex`` (compiled
   ``flex_attention``), so does what torch's fused SDPA kernels cannot take (grouped-query in
   float32), and ``math`` (the L x S weights) only serves what nothing else can. A backend
   whose ``dense_allocation`` (its L x S memory) is above attnkit's memory limit
   (:mod:`attnkit.memory`) is refused when named and passed over by ``auto``, which then takes
   the first backend that serves the call within the limit, its rule fired or not; if none
   does, :class:`~attnkit.AttentionMemoryError` says how much and the way out.
3. ``backend.run(call)``, through :func:`attnkit.backends.nonfinite.serve` (NaN or inf in q, k
   or v: the backend runs with them zeroed and the rows that could see them are set to NaN;
   a finite call pays one sum per tensor): ``blocked`` plans the call once
   (:mod:`attnkit.backends.blocked.plan`: attnkit's row-span kernel where the mask allows one
   run of keys per query row (for bfloat16 on a CPU with AVX512-BF16, its build on the CPU's
   bf16 dot products), else tiles of torch's fused CPU kernel over the non-empty blocks; on
   CUDA, torch matmuls on those tiles) and runs it forward (and backward, from the same plan)
   with autograd.
4. :func:`attnkit.functional.run_call` hands the output of a backend whose graph does not
   differentiate twice (``twice_differentiable``: all but ``math``) to
   :mod:`attnkit.backends.second_order`, so that a second derivative (``create_graph=True``)
   is the math backend's; first derivatives stay the backend's own.

Inside ``torch.compile`` (``fullgraph=True`` included) the dispatcher makes the same choice, and
the choice traces: ``blocked`` runs as one custom op, ``attnkit::blocked_attention``
(:mod:`attnkit.backends.blocked.compiled`: the same kernels, planned when the op runs), ``flex``
calls ``flex_attention`` inside the graph, and ``sdpa`` and ``math`` are torch ops.
:func:`attnkit.explain`'s notes say what a compiled call runs where it differs.

Dense backends (``math``, ``sdpa``) ask the call for ``call.dense_mask()`` (materialised once);
spec backends (``blocked``, ``flex``) read ``call.mask``; kernels with a causal flag read
``call.causal``. No backend sees an argument it cannot take, so none re-checks its input.

Adding a backend is one file: subclass :class:`Backend`, register an instance::

    import torch
    from attnkit.backends import Backend, register_backend

    class Reference(Backend):
        name = "reference"
        description = "float64 matmul, softmax, matmul"
        priority = None                   # only when named; a number puts it in auto's order

        def check(self, call):
            return "no weights" if call.return_weights else None

        def run(self, call):
            mask = call.dense_mask()     # None, bool (True = may attend) or float (added)
            ...
            return out, None

    register_backend(Reference())

``tests/backends/test_registry.py`` registers a toy backend this way.
"""

from __future__ import annotations

import torch

from attnkit.backends.base import Backend
from attnkit.call import AttentionCall
from attnkit.errors import AttentionInputError
from attnkit.memory import exceeds
from attnkit.validate import too_big_error

__all__ = [
    "AUTO_ORDER",
    "Backend",
    "auto_order",
    "available_backends",
    "choose",
    "get_backend",
    "over_limit",
    "register_backend",
    "unregister_backend",
]

_REGISTRY: dict[str, Backend] = {}

#: the backends ``auto`` tries on CPU, by descending priority (kept in step with the registry);
#: :func:`auto_order` gives the order on another device type
AUTO_ORDER: list[str] = []


def auto_order(device_type: str = "cpu") -> list[str]:
    """The backends ``auto`` tries on ``device_type``, by descending priority there
    (:meth:`Backend.priority_on`); on CPU (and any device no backend names) this is
    :data:`AUTO_ORDER`."""
    ranked = [b for b in _REGISTRY.values() if b.priority_on(device_type) is not None]
    ranked.sort(key=lambda b: -(b.priority_on(device_type) or 0))  # stable: by registration
    return [b.name for b in ranked]


def _reorder() -> None:
    AUTO_ORDER[:] = auto_order("cpu")


def register_backend(backend: Backend) -> Backend:
    """Register ``backend`` under ``backend.name``; its ``priority`` places it in ``auto``."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend takes a Backend instance, not {type(backend).__name__}")
    if not backend.name or backend.name == "auto" or backend.name in _REGISTRY:
        raise ValueError(f"a backend named {backend.name!r} is already registered or reserved")
    _REGISTRY[backend.name] = backend
    _reorder()
    return backend


def unregister_backend(name: str) -> None:
    """Remove a backend registered with :func:`register_backend` (``KeyError`` if none)."""
    del _REGISTRY[name]
    _reorder()


def get_backend(name: str) -> Backend:
    """The backend registered under ``name`` (``KeyError`` if none)."""
    return _REGISTRY[name]


def available_backends() -> list[str]:
    """Names of all registered backends, in registration order."""
    return list(_REGISTRY)


def rule_of(backend: Backend, call: AttentionCall) -> tuple[bool, str]:
    """``(fires, why)`` of ``backend``'s auto rule; a backend without one always fires."""
    rule = backend.rule(call)
    if rule is None:
        order = auto_order(call.device_type)
        where = "" if order == AUTO_ORDER else f" on {call.device_type}"
        return True, f"the first in auto's order{where} ({' > '.join(order)}) that can serve"
    return rule


def choose(call: AttentionCall, backend: str, where: str) -> Backend:
    """The backend that runs ``call``: named (must serve it) or ``"auto"``."""
    if backend == "auto":
        order = auto_order(call.device_type)
        too_big: tuple[Backend, tuple[int, str], int] | None = None
        for name in order:
            chosen = _REGISTRY[name]
            if rule_of(chosen, call)[0] and chosen.check(call) is None:
                over = over_limit(chosen, call)
                if over is None:
                    return chosen
                too_big = too_big or (chosen, *over)
        if too_big is not None:  # then any backend that serves the call within the limit
            for name in order:
                chosen = _REGISTRY[name]
                if chosen.check(call) is None and over_limit(chosen, call) is None:
                    return chosen
            raise too_big_error(where, call, too_big[0].name, *too_big[1], too_big[2])
        raise AttentionInputError(  # unreachable while `math` serves every call
            where,
            "backend",
            "no registered backend can serve this call.",
            got=f"backends tried: {', '.join(order)}",
            expected="at least one backend that serves the call",
            fix="attnkit.explain(...) with the same arguments lists each backend's reason",
        )
    if not isinstance(backend, str) or backend not in _REGISTRY:
        raise AttentionInputError(
            where,
            "backend",
            f"unknown backend {backend!r}.",
            got=f"backend={backend!r}",
            expected=f"'auto' or one of {available_backends()}",
            fix="backend='auto' picks the fastest backend that can serve the call",
        )
    chosen = _REGISTRY[backend]
    reason = chosen.check(call)
    if reason is not None:
        raise AttentionInputError(
            where,
            "backend",
            f"backend {backend!r} cannot serve this call: {reason}.",
            got=f"backend={backend!r}",
            expected="a backend that can serve the call (attnkit never falls back silently)",
            fix="backend='auto' takes one that can; attnkit.explain(...) shows why",
        )
    over = over_limit(chosen, call)
    if over is not None:
        raise too_big_error(where, call, backend, *over[0], over[1])
    return chosen


def over_limit(backend: Backend, call: AttentionCall) -> tuple[tuple[int, str], int] | None:
    """``((bytes, what), limit)`` when ``backend``'s L x S memory for ``call`` is above
    attnkit's memory limit (:mod:`attnkit.memory`), else ``None`` (always while
    ``torch.compile`` traces: the guard reads the free memory, which a graph cannot)."""
    if torch.compiler.is_compiling():
        return None
    need = backend.dense_allocation(call)
    limit = None if need is None else exceeds(need[0], call.q.device)
    return None if need is None or limit is None else (need, limit)


def _register_builtin() -> None:
    from attnkit.backends.blocked import BlockedBackend
    from attnkit.backends.flex import FlexBackend
    from attnkit.backends.math import MathBackend
    from attnkit.backends.sdpa import SdpaBackend

    for backend in (SdpaBackend(), MathBackend(), BlockedBackend(), FlexBackend()):
        register_backend(backend)


_register_builtin()
