"""The backend registry: plain functions with one signature, registered by name.

A backend is two functions with the same keyword signature::

    run(q, k, v, *, mask, causal, scale, dropout_p, return_weights) -> (out, weights | None)
    check(q, k, v, *, mask, causal, scale, dropout_p, return_weights) -> str | None

``check`` returns ``None`` when the backend can serve the call, and otherwise the reason it
cannot, in words that :func:`attnkit.explain` shows. Backends receive validated, prepared input
(see :func:`attnkit.functional.attention`): ``mask`` is ``None``, a bool mask (True = may attend)
or a float mask (added to the scores), broadcastable to ``(B, H, L, S)``, or, for a backend
registered with ``takes_specs=True``, a :class:`~attnkit.masks.MaskSpec` (the others get the
spec materialised); ``causal`` is the end-aligned causal rule and never comes together with a
mask; ``scale`` is a float. A backend
never validates again and never falls back to another one.

``auto`` walks :data:`AUTO_ORDER` and takes the first backend whose ``check`` passes and, for
a backend registered with a ``rule``, whose rule fires. A rule has the same keyword signature and
returns ``(fires, why)``: ``blocked``'s fires for a mask spec on a large enough problem, so that
``auto`` sends structured masks there and everything else on down the order (sdpa, then math).
:func:`attnkit.explain` prints the rule that decided. A backend may also register a ``note``
(same signature, returns a line) that ``explain`` prints: its plan, or its compile state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from attnkit.masks import MaskSpec

#: what a backend's ``mask`` argument may be
Mask = torch.Tensor | MaskSpec | None

__all__ = [
    "AUTO_ORDER",
    "Backend",
    "BackendCheck",
    "BackendNote",
    "BackendRule",
    "BackendRun",
    "Mask",
    "available_backends",
    "get_backend",
    "register_backend",
    "unregister_backend",
]


class BackendRun(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: Mask,
        causal: bool,
        scale: float,
        dropout_p: float,
        return_weights: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class BackendCheck(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: Mask,
        causal: bool,
        scale: float,
        dropout_p: float,
        return_weights: bool,
    ) -> str | None: ...


class BackendRule(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: Mask,
        causal: bool,
        scale: float,
        dropout_p: float,
        return_weights: bool,
    ) -> tuple[bool, str]: ...


class BackendNote(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: Mask,
        causal: bool,
        scale: float,
        dropout_p: float,
        return_weights: bool,
    ) -> str: ...


@dataclass(frozen=True)
class Backend:
    """A registered backend: its name, its two functions and a one-line description.

    ``fused`` says that it never materialises the ``(B, H, L, S)`` scores and weights;
    ``takes_specs`` that it evaluates :mod:`attnkit.masks` specs itself (block by block).
    ``rule`` (optional) says when ``auto`` takes it, ``note`` (optional) adds a line to
    :func:`attnkit.explain`.
    """

    name: str
    run: BackendRun
    check: BackendCheck
    description: str
    fused: bool = False
    takes_specs: bool = False
    rule: BackendRule | None = None
    note: BackendNote | None = None


_REGISTRY: dict[str, Backend] = {}

#: The order in which ``backend="auto"`` tries the backends: fastest first.
AUTO_ORDER: list[str] = []


def register_backend(
    name: str,
    run: BackendRun,
    check: BackendCheck,
    description: str,
    *,
    auto_rank: int | None = None,
    fused: bool = False,
    takes_specs: bool = False,
    rule: BackendRule | None = None,
    note: BackendNote | None = None,
) -> Backend:
    """Register a backend under ``name``; ``auto_rank`` places it in :data:`AUTO_ORDER`.

    ``auto_rank=None`` keeps it out of ``auto`` (it is used only when named). With a ``rule``,
    ``auto`` takes it only where the rule fires (and ``check`` passes).
    """
    if name == "auto" or name in _REGISTRY:
        raise ValueError(f"a backend named {name!r} is already registered")
    backend = Backend(name, run, check, description, fused, takes_specs, rule, note)
    _REGISTRY[name] = backend
    if auto_rank is not None:
        AUTO_ORDER.insert(auto_rank, name)
    return backend


def unregister_backend(name: str) -> None:
    """Remove a backend registered with :func:`register_backend` (``KeyError`` if none)."""
    del _REGISTRY[name]
    if name in AUTO_ORDER:
        AUTO_ORDER.remove(name)


def get_backend(name: str) -> Backend:
    """The backend registered under ``name`` (``KeyError`` if none)."""
    return _REGISTRY[name]


def available_backends() -> list[str]:
    """Names of all registered backends, in registration order."""
    return list(_REGISTRY)


def _register_builtin() -> None:
    from attnkit.backends import blocked, flex, math, sdpa

    register_backend("sdpa", sdpa.run, sdpa.check, sdpa.DESCRIPTION, auto_rank=0, fused=True)
    register_backend("math", math.run, math.check, math.DESCRIPTION, auto_rank=1)
    register_backend(
        "blocked",
        blocked.run,
        blocked.check,
        blocked.DESCRIPTION,
        auto_rank=0,
        fused=True,
        takes_specs=True,
        rule=blocked.rule,
        note=blocked.note,
    )
    register_backend(
        "flex", flex.run, flex.check, flex.DESCRIPTION, fused=True, takes_specs=True, note=flex.note
    )


_register_builtin()
