"""A transformers mask rule attnkit cannot read, as a function mask: :func:`function_spec`.

Dimension legend: B batch, L query length, S key length.

Where :func:`attnkit.interop.hf_rules.rule_spec` cannot prove transformers' rule as one of
attnkit's specs (a model's own mask function, Gemma 3's window over image blocks longer than
it, a remap of chunks), the rule still reaches attnkit as a rule, never as a guess:
``from_function`` wrapping transformers' own ``mask_function``, called as transformers'
``sdpa_mask`` calls it:

- at absolute positions: attnkit's query row ``i`` is ``q_offset + i``, key ``j`` is
  ``kv_offset + j``, as int64 indices (``sdpa_mask``'s ``torch.arange``);
- at head 0 for every head (``sdpa_mask`` evaluates ``head_arange = arange(1)``);
- through broadcasting index tensors where transformers broadcasts them (``use_vmap=False``,
  its default), and through ``torch.vmap`` over the four indices inside
  ``TransformGetItemToIndex`` where transformers does (``use_vmap=True``: ``create_causal_mask``
  with ``or_mask_function`` / ``and_mask_function``, which may not be index-based);
- the padding ``and``-ed on (``and_masks(mask_function, padding_mask_function(mask))``), here
  as ``key_mask`` of the padding cut to the call's keys (False past its end, as
  ``prepare_padding_mask`` pads it): the same mask, and the backends' key padding path.

``sdpa_mask``'s ``allow_is_causal_skip`` / ``allow_is_bidirectional_skip`` (and the
``local_size`` they read) only decide whether it returns ``None`` instead of a mask; attnkit's
mask interface never does, so they do not apply. A function the probe cannot evaluate on the
call's own index ranges (a table shorter than the positions, an operation index tensors do not
support) gives ``None``: the caller hands transformers' dense mask instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from attnkit.interop.hf_rules import UNMASKED, Reading, padding_keys
from attnkit.masks import MaskSpec, from_function

__all__ = ["function_spec", "transformers_rule"]

MaskFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: the in_dims of transformers' ``_vmap_expansion_sdpa``, innermost (the keys) first
_VMAP_DIMS = (
    (None, None, None, 0),
    (None, None, 0, None),
    (None, 0, None, None),
    (0, None, None, None),
)


def transformers_rule(
    fn: Callable[..., Any], q_offset: int, kv_offset: int, use_vmap: bool
) -> MaskFunction:
    """``fn`` as a ``from_function`` mask function of attnkit's raw indices (query rows
    ``0 .. L - 1``, keys ``0 .. S - 1``), evaluated as ``sdpa_mask`` evaluates it (see the
    module doc)."""

    def rule(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        head = torch.zeros((1,) * h.dim(), dtype=torch.long, device=h.device)
        idx = (b.long(), head, q.long() + q_offset, kv.long() + kv_offset)
        if not use_vmap:
            return fn(*idx)  # type: ignore[no-any-return]
        return _vmapped(fn, idx)

    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    rule.__qualname__ = rule.__name__ = f"transformers[{name}]"
    return rule


def _vmapped(fn: Callable[..., Any], idx: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``fn`` on each (b, h, q, kv) of the broadcast indices through ``torch.vmap``:
    transformers' nesting (one vmap per index) where each index lies along its own axis, as
    ``sdpa_mask`` passes them, else one vmap over every pair of the broadcast shape."""
    # imported here: torch._dynamo imports sympy (seconds), which `import attnkit` must not
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    with TransformGetItemToIndex():
        if all(_along(t, axis) for axis, t in enumerate(idx)):
            nested = fn
            for in_dims in _VMAP_DIMS:
                nested = torch.vmap(nested, in_dims=in_dims, out_dims=0)
            return nested(*(t.reshape(-1) for t in idx))  # type: ignore[no-any-return]
        ndim = max(t.dim() for t in idx)
        sizes = [(1,) * (ndim - t.dim()) + tuple(t.shape) for t in idx]
        shape = tuple(max(col) for col in zip(*sizes, strict=True))
        flat = [t.expand(shape).reshape(-1) for t in idx]
        return torch.vmap(fn)(*flat).view(shape)  # type: ignore[no-any-return]


def _along(t: torch.Tensor, axis: int) -> bool:
    """Whether ``t`` is 4-D with every dimension but ``axis`` of size 1."""
    return t.dim() == 4 and all(n == 1 for d, n in enumerate(t.shape) if d != axis)


def function_spec(
    fn: Callable[..., Any],
    padding: torch.Tensor | None,
    at: Reading,
    use_vmap: bool,
    device: torch.device | str = "cpu",
) -> MaskSpec | None:
    """transformers' rule ``fn`` with its 2-D padding mask (``(B, >= kv_offset + S)``, True = a
    real token) as ``from_function(...) [& key_mask(keep)]``, or ``None`` where it cannot be
    evaluated on this call's positions (or the offsets are not plain ints); ``device`` is where
    transformers would build the mask (the probe's indices are made there)."""
    if type(at.q_offset) is not int or type(at.kv_offset) is not int:
        return None
    keys: MaskSpec = UNMASKED
    if padding is not None:
        read = padding_keys(padding, at)
        if read is None:
            return None
        keys = read
    rule = transformers_rule(fn, at.q_offset, at.kv_offset, use_vmap)
    try:
        batch = _batch_of(rule, at, torch.device(device))
        spec = from_function(rule, batch=batch)
    except Exception:  # whatever the function raised: transformers' dense mask (as it is)
        return None
    return spec if keys is UNMASKED else spec & keys


def _batch_of(rule: MaskFunction, at: Reading, dev: torch.device) -> int | None:
    """``B`` where the rule's values depend on the batch row, else ``None``; evaluates it on the
    first and last query rows against every key of each row (``2 B S`` pairs), which raises
    where the function cannot be evaluated on the call's positions."""
    b = torch.arange(at.B, device=dev).view(-1, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
    q = torch.tensor(sorted({0, at.L - 1}), device=dev).view(1, 1, -1, 1)
    kv = torch.arange(at.S, device=dev).view(1, 1, 1, -1)
    out = rule(b, h, q, kv)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        raise TypeError(f"the mask function returned {type(out).__name__}, not a bool tensor")
    return at.B if at.B > 1 and out.dim() == 4 and out.shape[0] == at.B else None
