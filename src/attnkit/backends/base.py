"""What a backend is: a class with ``run``, ``check``, ``rule`` and ``note`` on one call.

See :mod:`attnkit.backends` for how the dispatcher uses them and how to add one.
"""

from __future__ import annotations

import torch

from attnkit.call import AttentionCall

__all__ = ["Backend", "mask_planning"]


class Backend:
    """Base class of every backend; subclass it, set the class attributes, register an instance.

    Class attributes:
        name: what ``attention(..., backend=name)`` selects.
        description: one line for :func:`attnkit.explain` and ``attnkit doctor``.
        priority: ``auto`` tries backends from the highest priority down; ``None`` keeps the
            backend out of ``auto`` (used only when named).
        priorities: per device type (``call.device_type``), a priority that replaces
            ``priority`` there, e.g. ``{"cuda": 40}``; devices not listed use ``priority``.
        fused: it never materialises the ``(B, H, L, S)`` scores (for traces and docs).
        twice_differentiable: its output's autograd graph differentiates any number of times
            (plain torch ops, as ``math``), and is left as it is. Otherwise (the default) a
            second derivative (``create_graph=True``) is the math backend's, recomputed
            (:mod:`attnkit.backends.second_order`); first derivatives stay the backend's own.

    Every method takes the validated :class:`~attnkit.AttentionCall` and nothing else.
    """

    name: str = ""
    description: str = ""
    priority: int | None = None
    priorities: dict[str, int | None] = {}  # noqa: RUF012 (read-only class data)
    fused: bool = False
    twice_differentiable: bool = False

    def priority_on(self, device_type: str) -> int | None:
        """This backend's place in ``auto``'s order on ``device_type`` (``None``: not in it)."""
        return self.priorities.get(device_type, self.priority)

    def describe(self, device_type: str) -> str:
        """:attr:`description`, as true on ``device_type`` (a backend whose kernels differ by
        device overrides this)."""
        return self.description

    def run(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out (B, H, L, Dv), weights (B, H, L, S) or None)``. Called only after
        :meth:`check` passed; never validates again and never falls back to another backend."""
        raise NotImplementedError

    def check(self, call: AttentionCall) -> str | None:
        """``None`` when this backend can serve the call, else the reason it cannot (shown by
        :func:`attnkit.explain`, and in the error when the backend was named)."""
        return None

    def rule(self, call: AttentionCall) -> tuple[bool, str] | None:
        """``auto``'s rule for this backend: ``(fires, why)``, or ``None`` for no rule (it is
        taken wherever :meth:`check` passes and no backend of higher priority was)."""
        return None

    def dense_allocation(self, call: AttentionCall) -> tuple[int, str] | None:
        """The memory this backend allocates for the call that grows as ``L x S`` (scores,
        weights, a materialised mask spec): ``(bytes, what it is)``, or ``None`` for none.
        The dispatcher refuses a backend whose need is above attnkit's memory limit
        (:mod:`attnkit.memory`), and ``auto`` takes another one that can serve."""
        return None

    def note(self, call: AttentionCall) -> str | None:
        """An extra line for :func:`attnkit.explain` (a plan, a compile state), or ``None``."""
        return None


def mask_planning(call: AttentionCall) -> tuple[int, str] | None:
    """The L x S memory of a backend that plans a mask block by block (``blocked``, ``flex``):
    a mask tensor is planned from int64 prefix sums of its shape (a spec of rules needs none),
    so that ``auto`` passes the backend over where they would not fit."""
    nbytes = 0 if call.mask is None else call.mask.planning_bytes()
    if not nbytes:
        return None
    return nbytes, "int64 prefix sums of the mask tensor, to plan its blocks"
