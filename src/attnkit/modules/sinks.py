"""Attention sinks in the modules: a learned logit per head, or sinks passed per call.

Dimension legend: B batch, H query heads, L query length (the new tokens with a KV cache).

A sink is a logit that joins the softmax denominator of every row it belongs to and adds no
value (gpt-oss's ``s_aux``): the weights of a row may sum to less than 1. A module built with
``sinks=True`` holds one learned sink per query head, the parameter ``sinks`` ``(H,)``
(``state_dict`` key ``sinks``, as ``self_attn.sinks`` in transformers' gpt-oss), initialised
as gpt-oss initialises it: ``normal_(mean=0, std=0.02)`` (its config's ``initializer_range``).
A call may pass ``sinks=`` instead: ``(H,)``, or per token ``(B, H, L)`` / ``(1, H, L)``
(heads before rows, as in q, whatever the module's layout), checked by
:func:`attnkit.validate.check_sinks` with the module's name in the message.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnkit.call import Dims
from attnkit.errors import DTYPES, AttentionInputError
from attnkit.validate import check_sinks

__all__ = ["SINKS_INIT_STD", "learned_sinks", "module_sinks"]

#: the standard deviation of the learned sinks' initial values: gpt-oss's ``initializer_range``
SINKS_INIT_STD = 0.02


def learned_sinks(
    where: str, sinks: object, num_heads: int, factory: dict[str, Any]
) -> nn.Parameter | None:
    """The learned sinks ``(H,)`` of a module built with ``sinks=True`` (on ``factory``'s
    device and dtype), or ``None`` for ``sinks=False``."""
    if not isinstance(sinks, bool):
        shown = f"tensor {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor) else repr(sinks)
        raise AttentionInputError(
            where,
            "sinks",
            "the constructor's `sinks` is a flag: True gives the module one learned sink per head.",
            got=f"sinks={shown}",
            expected="sinks=True or sinks=False",
            fix="build the module with sinks=True for learned sinks (then load their values "
            "into module.sinks), or pass a sinks tensor to each call: module(x, sinks=...)",
        )
    if not sinks:
        return None
    param = nn.Parameter(torch.empty(num_heads, **factory))  # (H,)
    nn.init.normal_(param, mean=0.0, std=SINKS_INIT_STD)
    return param


def module_sinks(
    where: str,
    learned: torch.Tensor | None,
    given: object,
    q: torch.Tensor,
) -> torch.Tensor | None:
    """The sinks of a module's call with heads ``q (B, H, L, Dk)``: the module's ``learned``
    sinks, or the ``given`` per-call ones (not both), checked. Under autocast, where q comes
    from the projections in autocast's dtype, floating sinks of another dtype are cast to q's
    as autocast casts the projections' weights; elsewhere nothing is cast."""
    if learned is not None and given is not None:
        raise AttentionInputError(
            where,
            "sinks",
            "this module has learned sinks (built with sinks=True), and the call passes "
            "sinks= too; a row's softmax takes one set.",
            got=f"module.sinks (H={learned.shape[0]},) and sinks= {_shown(given)}",
            expected="sinks=None for a module with learned sinks",
            fix="drop the call's sinks=, or build the module with sinks=False to pass them "
            "per call",
        )
    sinks = learned if learned is not None else given
    if sinks is None:
        return None
    if (
        isinstance(sinks, torch.Tensor)
        and torch.is_autocast_enabled(q.device.type)
        and sinks.dtype in DTYPES
        and sinks.dtype != q.dtype
    ):
        sinks = sinks.to(q.dtype)
    B, H, L, Dk = q.shape
    check_sinks(sinks, q, Dims(B, H, H, L, L, Dk, Dk), where=where)  # reads B, H and L only
    assert isinstance(sinks, torch.Tensor)  # check_sinks refuses anything else
    return sinks


def _shown(t: object) -> str:
    return f"{tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
