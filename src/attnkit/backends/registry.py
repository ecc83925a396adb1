"""The registry of backends, auto's order, and each backend's one decision per call.

See :mod:`attnkit.backends` for the path of one call and how to add a backend.
"""

from __future__ import annotations

import inspect

from attnkit.backends.base import Backend, Decision
from attnkit.call import AttentionCall

__all__ = [
    "AUTO_ORDER",
    "auto_order",
    "available_backends",
    "decision",
    "get_backend",
    "register_backend",
    "unregister_backend",
]

_REGISTRY: dict[str, Backend] = {}

#: the backends ``auto`` tries on CPU, by descending priority (kept in step with the registry);
#: :func:`auto_order` gives the order on another device type
AUTO_ORDER: list[str] = []

#: the hooks backends answered before :meth:`Backend.decide` replaced them
_OLD_HOOKS = ("check", "rule", "note", "dense_allocation")


#: auto's order per device type, as :func:`auto_order` ranks it (cleared when the registry
#: changes: a backend's priority places it when it is registered)
_ORDERS: dict[str, tuple[Backend, ...]] = {}


def auto_order(device_type: str = "cpu") -> list[str]:
    """The backends ``auto`` tries on ``device_type``, by descending priority there
    (:meth:`Backend.priority_on`); on CPU (and any device no backend names) this is
    :data:`AUTO_ORDER`."""
    return [b.name for b in ordered(device_type)]


def ordered(device_type: str) -> tuple[Backend, ...]:
    """The backends of :func:`auto_order`, ranked once per device type and registry."""
    found = _ORDERS.get(device_type)
    if found is None:
        ranked = [b for b in _REGISTRY.values() if b.priority_on(device_type) is not None]
        ranked.sort(key=lambda b: -(b.priority_on(device_type) or 0))  # stable: registration
        found = _ORDERS[device_type] = tuple(ranked)
    return found


def _reorder() -> None:
    from attnkit.backends import memo  # the decisions kept were made by the old registry

    _ORDERS.clear()
    AUTO_ORDER[:] = auto_order("cpu")
    memo.clear()


def register_backend(backend: Backend) -> Backend:
    """Register ``backend`` under ``backend.name``; its ``priority`` places it in ``auto``.

    A backend answers :meth:`Backend.decide` and :meth:`Backend.run` (see
    :mod:`attnkit.backends`); one that still defines the hooks ``decide`` replaced (``check``,
    ``rule``, ``note``, ``dense_allocation``) is refused, since attnkit would no longer ask
    them (its refusals would be ignored), and so is one whose ``run`` takes no plan."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend takes a Backend instance, not {type(backend).__name__}")
    old = [hook for hook in _OLD_HOOKS if callable(getattr(backend, hook, None))]
    if old:
        raise TypeError(
            f"backend {backend.name!r} defines {', '.join(old)}: attnkit asks a backend one "
            "question per call, decide(call) -> Decision (whether it serves and why not, auto's "
            "rule, its L x S memory, its plan, explain's note), and runs run(call, plan); see "
            "attnkit.backends"
        )
    try:
        inspect.signature(backend.run).bind(None, None)
    except TypeError:
        raise TypeError(
            f"backend {backend.name!r}: run takes (call, plan), the plan of its decision "
            "(None where decide made none); see attnkit.backends"
        ) from None
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


def decision(call: AttentionCall, name: str) -> Decision:
    """The decision of the backend registered as ``name`` for ``call``, asked once per call:
    the dispatcher, :func:`attnkit.explain` and a backend whose rule reads another's decision
    (``flex`` on CUDA reads ``sdpa``'s) share it. ``KeyError`` if no such backend."""
    made = call._decisions
    found = made.get(name)
    if found is None:
        found = made[name] = _REGISTRY[name].decide(call)
    return found
