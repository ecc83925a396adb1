"""The backends and the dispatcher: which code computes one attention call.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.

This is the one description of the path of a call; the other modules point here. The path of
``attnkit.attention(q, k, v, mask=masks.causal() & masks.sliding_window(256))``:

1. The checks of :mod:`attnkit.validate` and :mod:`attnkit.mask_checks` read the arguments
   (q/k/v into :class:`~attnkit.call.Dims`, the numbers, the mask, the sinks), then
   :meth:`AttentionCall.build` makes one frozen :class:`~attnkit.AttentionCall`;
   :func:`attnkit.masks.as_spec` folds the ``causal`` flag and the mask into one spec there,
   the only place they combine.
2. :func:`choose` collects decisions and picks one. Each backend is asked one question per
   call, :meth:`Backend.decide`, whose :class:`Decision` holds everything about it: whether it
   can serve the call and why not, ``auto``'s rule for it, its L x S memory, its plan, and the
   note :func:`attnkit.explain` prints. A decision is made at most once per call
   (:func:`~attnkit.backends.registry.decision` keeps it with the call), and read by the
   dispatcher, the run and ``explain`` alike. A named backend runs if its decision serves the
   call (else an error, never a fallback). ``"auto"`` asks the backends by descending priority
   on the call's device (:func:`auto_order`) and stops at the first whose decision serves the
   call, whose rule fires, and whose memory is within attnkit's limit (:mod:`attnkit.memory`);
   the backends after it are not asked. On CPU the order is ``blocked > sdpa > math`` and a
   spec on a large problem goes to ``blocked``; on CUDA it is ``flex > sdpa > blocked > math``:
   a spec goes to ``flex`` (compiled ``flex_attention``), so does what torch's fused SDPA
   kernels cannot take (grouped-query in float32: flex's rule reads sdpa's decision), and
   ``math`` (the L x S weights) only serves what nothing else can. Where the backends whose rule
   fires are all above the memory limit, ``auto`` takes the first in its order that serves the
   call within it, its rule fired or not (every backend in the order has been asked by then);
   if none does, :class:`~attnkit.AttentionMemoryError` says how much and the way out.
   ``explain`` asks every registered backend, and prints the same decisions. A call like an
   earlier one (sizes, strides, dtype, device, flags, the mask spec's key) takes the decision
   that call took, kept in a bounded cache (:mod:`attnkit.backends.memo`): a decode step asks
   no backend again, at any layer; its checks (step 1) and the memory limit still run. One
   step further, where the backend offers it (:meth:`Backend.direct`: the decode kernel, and
   SDPA on q, k, v as they are without a mask tensor), an eager CPU call without gradients
   whose signature (sizes, dtypes, strides, flags, the spec's key) equals an earlier one's
   runs that call's kernel on its tensors and nothing else: the checks of step 1 read only
   the signature, so they would pass again, and NaN or inf (the decode kernel reports it;
   SDPA's direct run sums q, k and v first) sends the call down the whole path.
3. :meth:`Choice.run` runs the decision under the contract every backend runs under:
   ``backend.run(call, decision.plan)``, where

   * NaN or inf in q, k or v (:mod:`attnkit.backends.nonfinite`, eager calls on the CPU): the
     backend runs on copies with them zeroed, and the rows that could see them are set to NaN;
     a finite call pays one sum per tensor, except where the plan checks what it reads itself
     (``plan.checks_finite``: the blocked backend's decode kernel and row-span forward);
   * second derivatives: the output of a backend whose graph does not differentiate twice
     (``twice_differentiable``: all but ``math``) goes through
     :mod:`attnkit.backends.second_order`, so that a second derivative (``create_graph=True``)
     is the math backend's; first derivatives stay the backend's own.

   ``blocked`` runs the plan its decision made (:mod:`attnkit.backends.blocked.plan`:
   attnkit's row-span kernel where the mask allows one run of keys per query row (for bfloat16
   on a CPU with AVX512-BF16, its build on the CPU's bf16 dot products), else tiles of torch's
   fused CPU kernel over the non-empty blocks; on CUDA, torch matmuls on those tiles), forward
   and backward from the same plan, with autograd.

Inside ``torch.compile`` (``fullgraph=True`` included) the dispatcher makes the same choice, and
the choice traces: ``blocked`` runs as one custom op, ``attnkit::blocked_attention``
(:mod:`attnkit.backends.blocked.compiled`: the same kernels, planned when the op runs), ``flex``
calls ``flex_attention`` inside the graph, and ``sdpa`` and ``math`` are torch ops; the memory
guard does not run (it reads the free memory, which a graph cannot). :func:`attnkit.explain`'s
notes say what a compiled call runs where it differs.

Dense backends (``math``, ``sdpa``) ask the call for ``call.dense_mask()`` (materialised once);
spec backends (``blocked``, ``flex``) read ``call.mask``; kernels with a causal flag read
``call.causal``. No backend sees an argument it cannot take, so none re-checks its input.

Adding a backend is one class in one file: subclass :class:`Backend`, answer ``decide`` and
``run``, register an instance::

    import torch
    from attnkit.backends import Backend, Decision, register_backend

    class Reference(Backend):
        name = "reference"
        description = "float64 matmul, softmax, matmul"
        priority = None                   # only when named; a number puts it in auto's order

        def decide(self, call):           # asked once per call
            if call.return_weights:
                return Decision(self.name, reason="no weights")
            return Decision(self.name)    # serves; no rule, no L x S memory, no plan

        def run(self, call, plan):        # plan: what decide put in Decision.plan
            mask = call.dense_mask()      # None, bool (True = may attend) or float (added)
            ...
            return out, None

    register_backend(Reference())

A decision may also carry ``rule=(fires, why)`` (auto's rule), ``memory=(bytes, what)`` (its
L x S memory, which the dispatcher holds to the limit), ``plan=`` (handed to ``run``) and
``note=`` (a line for ``explain``, made where ``call.explaining``). A backend whose plan can run
from the tensors alone may answer :meth:`Backend.direct` (see step 2).
``tests/backends/test_registry.py`` registers a toy backend this way, and
``tests/test_nonfinite_inputs.py`` holds every registered backend to the NaN rule.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from attnkit.backends import memo, nonfinite, second_order
from attnkit.backends.base import Backend, Decision
from attnkit.backends.registry import (
    AUTO_ORDER,
    auto_order,
    available_backends,
    decision,
    get_backend,
    ordered,
    register_backend,
    unregister_backend,
)
from attnkit.call import AttentionCall
from attnkit.errors import AttentionInputError
from attnkit.memory import exceeds, format_bytes
from attnkit.validate import too_big_error

__all__ = [
    "AUTO_ORDER",
    "Backend",
    "Choice",
    "Decision",
    "auto_order",
    "available_backends",
    "choose",
    "decision",
    "get_backend",
    "register_backend",
    "unregister_backend",
]


class Choice(NamedTuple):
    """What :func:`choose` found for one call: the decision that runs, and every decision it
    asked for (all registered backends for :func:`attnkit.explain`).

    ``limits`` holds, for each decision that serves the call and whose L x S memory was held to
    attnkit's limit, that limit in bytes where the memory is above it (``None`` where within);
    ``fallback``: ``auto`` took a backend whose rule does not fire, because those whose rule
    fires are above the limit.
    """

    call: AttentionCall
    backend: Backend
    decision: Decision
    requested: str
    where: str
    decisions: dict[str, Decision]
    limits: dict[str, int | None]
    fallback: bool = False

    @property
    def name(self) -> str:
        """The chosen backend's name."""
        return self.decision.backend

    @property
    def why(self) -> str:
        """The line that decided: auto's rule, or why a backend whose rule does not fire was
        taken."""
        if self.fallback:
            return (
                "the backends whose rule fires would allocate L x S tensors above attnkit's "
                f"memory limit; {self.name} is the first in auto's order that serves the call "
                "within it"
            )
        if self.decision.rule is not None:
            return self.decision.rule[1]
        device = self.call.device_type
        order = auto_order(device)
        on = "" if order == AUTO_ORDER else f" on {device}"
        why = f"the first in auto's order{on} ({' > '.join(order)}) that can serve"
        # the rules of the backends before it that serve the call but did not fire (a
        # measured rule that sends the call to torch, say): what chose
        before = order[: order.index(self.name)] if self.name in order else ()
        passed = [
            f"{n}'s rule: {d.rule[1]}"
            for n in before
            if (d := self.decisions.get(n)) is not None and d.reason is None and d.rule is not None
        ]
        return "; ".join([why, *passed])

    def verdict(self, name: str) -> str | None:
        """``None`` where backend ``name`` can serve the call within the memory limit, else why
        not, in explain's words."""
        d = self.decisions[name]
        limit = self.limits.get(name)
        if d.reason is not None or limit is None or d.memory is None:
            return d.reason
        nbytes, what = d.memory
        return (
            f"{what} would take {format_bytes(nbytes)}, above attnkit's memory limit of "
            f"{format_bytes(limit)}"
        )

    def run(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out, weights or None)``: the chosen backend's ``run`` on its decision's plan,
        under the contract of step 3 above (non-finite inputs, second derivatives)."""
        call, backend, plan = self.call, self.backend, self.decision.plan

        def run(c: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
            return backend.run(c, plan)

        checks = bool(getattr(plan, "checks_finite", False))  # the plan checks itself
        out, weights = nonfinite.serve(
            run, call, checks
        )  # NaN/inf in q, k, v: NaN where it reaches
        if weights is None and not backend.twice_differentiable:  # second derivatives: the
            out = second_order.wrap(call, backend.name, out, self.where)  # math backend's
        return out, weights


def choose(
    call: AttentionCall,
    backend: str = "auto",
    where: str = "attnkit.attention",
    every: bool = False,
) -> Choice:
    """The decision that runs ``call`` on ``backend`` (``"auto"`` or a name), as a
    :class:`Choice`; raises where a named backend cannot serve it, or nothing fits the memory
    limit. ``every``: ask every registered backend (for :func:`attnkit.explain`), not only
    those the choice needs."""
    decisions: dict[str, Decision] = {}
    limits: dict[str, int | None] = {}
    key = None if every else memo.call_key(call, backend)
    if key is not None:  # the decision of an earlier call just like this one (memo)
        kept: Decision | None = memo.find(key)
        if kept is not None and (kept.memory is None or _within(call, kept, limits)):
            decisions[kept.backend] = kept
            return Choice(call, get_backend(kept.backend), kept, backend, where, decisions, limits)
    fallback = False
    if backend == "auto":
        chosen, fallback = _auto(call, where, decisions, limits)
    else:
        chosen = _named(call, backend, where, decisions, limits)
    if key is not None and not fallback and all(v is None for v in limits.values()):
        memo.keep(key, chosen, call.mask)  # no backend was passed over for its memory
    if every:
        for name in available_backends():
            d = decisions.get(name) or _ask(call, name, decisions)
            if d.serves:
                _within(call, d, limits)
    return Choice(
        call, get_backend(chosen.backend), chosen, backend, where, decisions, limits, fallback
    )


def _ask(call: AttentionCall, name: str, decisions: dict[str, Decision]) -> Decision:
    d = decisions[name] = decision(call, name)
    return d


def _within(call: AttentionCall, d: Decision, limits: dict[str, int | None]) -> bool:
    """``d``'s memory is within attnkit's limit, checked once per decision (``limits`` holds the
    limit where above, ``None`` where within); always while ``torch.compile`` traces: the guard
    reads the free memory, which a graph cannot."""
    if d.memory is None or torch.compiler.is_compiling():
        return True
    if d.backend not in limits:
        limits[d.backend] = exceeds(d.memory[0], call.q.device)
    return limits[d.backend] is None


def _too_big(where: str, call: AttentionCall, d: Decision, limit: int | None) -> Exception:
    assert d.memory is not None
    assert limit is not None
    return too_big_error(where, call, d.backend, *d.memory, limit)


def _auto(
    call: AttentionCall,
    where: str,
    decisions: dict[str, Decision],
    limits: dict[str, int | None],
) -> tuple[Decision, bool]:
    """``auto``'s decision: the first in its order that serves, fires and fits (``False``);
    else the first that serves and fits (``True``); else the memory error. The backends after
    the one taken are not asked."""
    order = ordered(call.device_type)
    too_big: Decision | None = None
    for backend in order:
        d = _ask(call, backend.name, decisions)
        if d.reason is None and (d.rule is None or d.rule[0]):
            if _within(call, d, limits):
                return d, False
            too_big = too_big or d
    if too_big is not None:  # then any backend that serves the call within the limit
        for backend in order:
            d = decisions[backend.name]  # every one in the order was asked above
            if d.serves and not d.fires and _within(call, d, limits):
                return d, True
        raise _too_big(where, call, too_big, limits[too_big.backend])
    raise AttentionInputError(  # unreachable while `math` serves every call
        where,
        "backend",
        "no registered backend can serve this call.",
        got=f"backends tried: {', '.join(b.name for b in order)}",
        expected="at least one backend that serves the call",
        fix="attnkit.explain(...) with the same arguments lists each backend's reason",
    )


def _named(
    call: AttentionCall,
    backend: str,
    where: str,
    decisions: dict[str, Decision],
    limits: dict[str, int | None],
) -> Decision:
    """The decision of the backend named ``backend``, which must serve the call and fit."""
    if not isinstance(backend, str) or backend not in available_backends():
        raise AttentionInputError(
            where,
            "backend",
            f"unknown backend {backend!r}.",
            got=f"backend={backend!r}",
            expected=f"'auto' or one of {available_backends()}",
            fix="backend='auto' picks the fastest backend that can serve the call",
        )
    d = _ask(call, backend, decisions)
    if d.reason is not None:
        raise AttentionInputError(
            where,
            "backend",
            f"backend {backend!r} cannot serve this call: {d.reason}.",
            got=f"backend={backend!r}",
            expected="a backend that can serve the call (attnkit never falls back silently)",
            fix="backend='auto' takes one that can; attnkit.explain(...) shows why",
        )
    if not _within(call, d, limits):
        raise _too_big(where, call, d, limits[backend])
    return d


def _register_builtin() -> None:
    from attnkit.backends.blocked import BlockedBackend
    from attnkit.backends.flex import FlexBackend
    from attnkit.backends.math import MathBackend
    from attnkit.backends.sdpa import SdpaBackend

    for backend in (SdpaBackend(), MathBackend(), BlockedBackend(), FlexBackend()):
        register_backend(backend)


_register_builtin()
