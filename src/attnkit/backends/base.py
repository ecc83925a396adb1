"""What a backend is: a class that answers one :class:`Decision` per call and runs it.

See :mod:`attnkit.backends` for the path of one call (how the dispatcher reads the decisions)
and how to add a backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from attnkit.call import AttentionCall

__all__ = ["Backend", "Decision", "mask_planning"]


class Decision(NamedTuple):
    """One backend's answer for one call, made once (:meth:`Backend.decide`) and read by the
    dispatcher (:func:`attnkit.backends.choose`), by the run, and by :func:`attnkit.explain`.

    Fields:
        backend: the backend's name.
        reason: ``None`` when the backend can serve the call, else why it cannot (shown by
            :func:`attnkit.explain`, and in the error when the backend was named).
        rule: ``auto``'s rule for this call, ``(fires, why)``; ``None`` for no rule (auto takes
            the backend wherever it serves and no backend of higher priority was taken).
        memory: what the backend would allocate that grows as ``L x S`` (scores, weights, a
            materialised mask spec, prefix sums of a mask tensor): ``(bytes, what it is)``, or
            ``None``. The dispatcher refuses a decision above attnkit's memory limit
            (:mod:`attnkit.memory`); ``auto`` then takes another backend that fits.
        plan: what :meth:`Backend.run` is handed: the plan the decision made (``None`` where
            deciding did not need one: a backend that plans then makes it when it runs, so
            that ``auto`` spends nothing on a backend it passes over).
        note: an extra line for :func:`attnkit.explain` (a plan, a compile state); made when
            the call is explained (``call.explaining``), ``None`` otherwise.
        description: the backend's description as true for this call's device, where it
            differs from :attr:`Backend.description`.
    """

    backend: str
    reason: str | None = None
    rule: tuple[bool, str] | None = None
    memory: tuple[int, str] | None = None
    plan: Any = None
    note: str | None = None
    description: str | None = None

    @property
    def serves(self) -> bool:
        """The backend can serve the call (memory aside: the dispatcher checks that)."""
        return self.reason is None

    @property
    def fires(self) -> bool:
        """``auto``'s rule fires (a backend without a rule always fires)."""
        return self.rule is None or self.rule[0]


class Backend:
    """Base class of every backend; subclass it, set the class attributes, answer
    :meth:`decide` and :meth:`run`, register an instance.

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

    Both methods take the validated :class:`~attnkit.AttentionCall` and nothing else of the
    user's; the dispatcher asks :meth:`decide` at most once per call.
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

    def decide(self, call: AttentionCall) -> Decision:
        """Everything the dispatcher and :func:`attnkit.explain` need to know about this
        backend for ``call``, in one :class:`Decision`: whether it can serve it and why not,
        auto's rule, its L x S memory, its plan and explain's note. The default serves every
        call, with no rule, no L x S memory and no plan."""
        return Decision(self.name)

    def run(
        self, call: AttentionCall, plan: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out (B, H, L, Dv), weights (B, H, L, S) or None)``, given the plan of this
        backend's decision for the call (:attr:`Decision.plan`; ``None`` where the decision
        made none: a backend that plans makes it here). Called only where the decision serves
        the call, within the memory limit; never validates again and never falls back to
        another backend. On an eager CPU call NaN and inf in q, k or v never reach it (the
        dispatcher hands it zeroed copies and sets the rows that saw them to NaN:
        :mod:`attnkit.backends.nonfinite`)."""
        raise NotImplementedError

    def direct(
        self, call: AttentionCall, plan: Any = None
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None] | None:
        """A function that runs this decision's plan for any later call with the same
        signature as ``call`` (:func:`attnkit.backends.memo.direct_key`), given only its q, k
        and v: the output, or ``None`` where the whole path must run the call (NaN or inf
        read). ``None`` (the default): the backend offers none, and every call takes the
        whole path. Asked only for eager CPU calls without gradients, weights, dropout,
        soft-cap or sinks."""
        return None


def mask_planning(call: AttentionCall) -> tuple[int, str] | None:
    """The L x S memory of a backend that plans a mask block by block (``blocked``, ``flex``):
    a mask tensor is planned from int64 prefix sums of its shape (a spec of rules needs none),
    so that ``auto`` passes the backend over where they would not fit."""
    spec = call.mask
    nbytes = 0 if spec is None or not spec.from_tensor else spec.planning_bytes()
    if not nbytes:
        return None
    return nbytes, "int64 prefix sums of the mask tensor, to plan its blocks"
