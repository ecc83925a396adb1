"""NaN or inf in q, k or v: NaN wherever it can reach, and nowhere else, on every backend.

Dimension legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv query heads per
key/value head, L query length, S key length, n the key positions that hold a bad key or value.

The rule (README's conventions table), as the float64 oracle computes it (``tests/oracle.py``):

- a query row holding NaN or inf gives NaN output and NaN weights, whatever its mask;
- a query row that may attend (after the mask: causal, spec, sliding window, padding) to a key
  holding NaN or inf gives NaN output and NaN weights (its scores are not numbers);
- a query row that may attend to a value holding NaN or inf gives NaN output (the whole row);
  its weights, computed from q and k alone, stay what they are;
- every other row is exactly what it would be if the bad keys and values were absent: a row
  that cannot see them, and its gradient, do not depend on them.

Left to themselves the backends each break it their own way: torch's fused CPU kernels and
attnkit's take a NaN score for a masked one (a row that sees a NaN key comes out finite), and a
plain ``weights @ v`` gives every row NaN when one value is NaN, rows that give it weight 0
included (``0 * NaN``). So :func:`serve` runs the backend on inputs whose non-finite entries
are zeroed, then sets the rows that saw them to NaN. This is part of the contract every
backend's decision runs under (step 3 of :mod:`attnkit.backends`): the dispatcher runs each
through :func:`serve`, so a backend's ``run`` never sees a non-finite input on an eager CPU
call, and a new backend follows the rule with no code of its own
(``tests/test_nonfinite_inputs.py`` holds every registered backend to it).

Cost: the common all-finite call pays one sum of each of q, k and v, read as Python floats
(none where the plan checks what it reads, ``checks=True`` below: the blocked backend's decode
kernel, and its row-span kernel's forward, which check each element where they read it);
only a call that holds a non-finite number pays the per-row work (which key positions are bad,
and which query rows the mask lets see them, evaluated on those columns only). Eager calls on
the CPU only: elsewhere the sum would wait for the device (or, inside ``torch.compile``,
branch on data), and the call runs as the backend computes it.

A row set to NaN passes NaN back to the backend's backward wherever its gradient is not 0: a
loss that reads it is NaN and so are the gradients (as in torch's eager math, so that a
gradient scaler skips the step); a loss that does not read it gets the gradients of the rows
it reads, exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import replace
from typing import Any

import torch

from attnkit.call import AttentionCall

__all__ = ["NonFinite", "all_finite", "reporting", "sees_keys", "serve"]

#: (query row, bad key) pairs evaluated at once when finding the rows that see a bad key
_CHUNK_PAIRS = 1 << 20


Run = Callable[[AttentionCall], tuple[torch.Tensor, torch.Tensor | None]]

#: set while :func:`serve` runs a backend that checks its own inputs (``checks=True``)
_REPORTING: ContextVar[bool] = ContextVar("attnkit_nonfinite_reporting", default=False)


class NonFinite(Exception):  # noqa: N818 (a signal, not an error: serve catches it)
    """Raised by a backend that checks its own inputs (the decode kernel) when something it
    read was not finite, while :func:`reporting`: :func:`serve` then applies the rule."""


def reporting() -> bool:
    """Whether a backend that saw NaN or inf should raise :class:`NonFinite` (it runs under
    :func:`serve` with ``checks=True``), rather than return what it computed."""
    return _REPORTING.get()


def serve(
    run: Run, call: AttentionCall, checks: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``run(call)`` (a backend's run on its decision's plan) under the rule above:
    ``(out, weights or None)``. The dispatcher runs every backend through it
    (:meth:`attnkit.backends.Choice.run`). ``checks``: the plan reports non-finite inputs
    itself (the decode kernel and the row-span kernel's forward say whether a q, k or v
    element they read was not finite, raising :class:`NonFinite` while :func:`reporting`),
    so a finite call pays no sum over q, k, v; otherwise one float32 sum per tensor decides."""
    if not _checked(call):
        return run(call)
    if checks:
        token = _REPORTING.set(True)
        try:
            return run(call)
        except NonFinite:
            pass
        finally:
            _REPORTING.reset(token)
    elif _all_finite(call):
        return run(call)
    q, k, v = call.q, call.k, call.v
    fq, fk = torch.isfinite(q.detach()), torch.isfinite(k.detach())
    fv = fk if v is k else torch.isfinite(v.detach())
    bad_q = ~fq.all(dim=-1)  # (B, H, L)
    bad_k = ~fk.all(dim=-1)  # (B, Hkv, S)
    bad_v = ~fv.all(dim=-1)  # (B, Hkv, S)
    k_clean = _zeroed(k, fk)
    v_clean = k_clean if v is k else _zeroed(v, fv)
    out, weights = run(replace(call, q=_zeroed(q, fq), k=k_clean, v=v_clean))
    sees_kv = sees_keys(call, bad_k | bad_v)  # (B, H, L)
    out = nan_rows(out, bad_q | sees_kv)
    if weights is not None:  # NaN where a key was bad; a bad value leaves the weights as they are
        only_v = bool((bad_v & ~bad_k).any())
        weights = nan_rows(weights, bad_q | (sees_keys(call, bad_k) if only_v else sees_kv))
    return out, weights


def sees_keys(call: AttentionCall, bad: torch.Tensor) -> torch.Tensor:
    """``(B, H, L)`` bool: query row ``(b, h, i)`` may attend, under the call's mask, to a key
    position ``j`` with ``bad[b, h // G, j]`` (``bad`` is ``(B, Hkv, S)``). The mask is
    evaluated on the bad positions' columns only (:meth:`~attnkit.masks.MaskSpec.allowed`),
    never over ``L x S``."""
    B, H, Hkv, L, S = call.dims.B, call.dims.H, call.dims.Hkv, call.dims.L, call.dims.S
    dev = bad.device
    cols = bad.any(dim=1).any(dim=0).nonzero().flatten()  # (n,) positions bad somewhere
    seen = torch.zeros(B, H, L, dtype=torch.bool, device=dev)
    if cols.numel() == 0 or L == 0:
        return seen
    bad_h = bad[:, :, cols].repeat_interleave(H // Hkv, dim=1)  # (B, H, n)
    spec = call.mask
    if spec is None:  # every row sees every key
        return seen | bad_h.any(dim=-1, keepdim=True)
    b = torch.arange(spec.batch or 1, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(spec.heads or 1, device=dev).view(1, -1, 1, 1)
    i = torch.arange(L, device=dev).view(1, 1, L, 1)
    step = max(1, _CHUNK_PAIRS // max(1, B * H * L))
    for start in range(0, cols.numel(), step):
        j = cols[start : start + step]
        allowed = spec.allowed(b, h, i, j.view(1, 1, 1, -1), S - L)  # (B', H', L, n')
        seen |= (allowed & bad_h[:, :, None, start : start + step]).any(dim=-1)
    return seen


def nan_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x (B, H, L, *)`` with the rows ``rows (B, H, L)`` set to NaN (``x`` itself when there
    are none). Backward: the gradient of those rows is dropped where it is 0 and NaN where it is
    not, so that a loss reading them gives NaN gradients, and one that does not is untouched."""
    if not bool(rows.any()):
        return x
    out: torch.Tensor = _NanRows.apply(x, rows[..., None])  # type: ignore[no-untyped-call]
    return out


class _NanRows(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(rows, math.nan)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: Any) -> None:
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (rows,) = ctx.saved_tensors
        return grad.masked_fill(rows, 0.0).masked_fill(rows & (grad != 0), math.nan), None


def _checked(call: AttentionCall) -> bool:
    """The rule is applied here: an eager call on the CPU that computes something."""
    if call.explaining or call.q.device.type != "cpu":
        return False
    return not torch.compiler.is_compiling()


def _all_finite(call: AttentionCall) -> bool:
    return all_finite(call.q, call.k, call.v)


def all_finite(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """One sum of each of q, k, v (float32 and float64 in their dtype, bfloat16/float16 in
    float32), each read as a Python float: finite means every entry is (a sum of finite
    numbers that overflows sends the call down the exact path, which finds nothing). The three
    numbers are added in Python (float64: no overflow), not as tensors: on a decode step's
    small tensors each tensor operation costs more than the sum itself. :func:`serve`'s check,
    and that of a backend's direct run (:meth:`attnkit.backends.Backend.direct`) that does
    not check its inputs itself."""
    total = _sum(q) + _sum(k)
    if v is not k:
        total += _sum(v)
    return math.isfinite(total)


def _sum(t: torch.Tensor) -> float:
    if t.requires_grad:  # (detach only where needed: it is one more operation)
        t = t.detach()
    if t.dtype in _WIDEN:
        return t.sum(dtype=torch.float32).item()
    return t.sum().item()


_WIDEN = (torch.bfloat16, torch.float16)


def _zeroed(x: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """``x`` with its non-finite entries 0 (``x`` itself when it has none)."""
    if bool(finite.all()):
        return x
    return torch.where(finite, x, torch.zeros((), dtype=x.dtype))
