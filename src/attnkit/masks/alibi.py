"""ALiBi (Press et al.) as a mask spec: every pair allowed, a score bias per head.

Dimension legend: H heads, L query length, S key length; ``off = S - L`` end-aligns the queries.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch

from attnkit.errors import check_int
from attnkit.masks.keys import tensor_key
from attnkit.masks.spec import MaskSpec, _And

__all__ = ["alibi", "alibi_slopes", "split_alibi"]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi head slopes ``(H,)`` of Press et al. (float64).

    For ``H`` a power of 2 they are the geometric sequence ``2 ** (-8 (h + 1) / H)``; otherwise
    the slopes of the closest smaller power of 2, ``n``, followed by every other slope of
    ``2n`` heads, as in the paper's reference code.

    >>> alibi_slopes(8).tolist()
    [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625]
    """
    check_int("attnkit.alibi_slopes", "num_heads", num_heads)

    def power_of_2(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    n = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_2(n) + power_of_2(2 * n)[0::2][: num_heads - n]
    return torch.tensor(slopes, dtype=torch.float64)


class _ALiBi(MaskSpec):
    """Every pair allowed; score bias ``-slope_h * |q + off - kv|`` (position distance)."""

    has_bias = True
    scratch_bytes = 24  # the float64 bias and the int64 distances, per pair

    def __init__(self, num_heads: int, device: torch.device | str | None) -> None:
        self.heads = num_heads
        self.slopes = alibi_slopes(num_heads).to(device=device)  # (H,) float64

    def key(self) -> Hashable:
        return ("alibi", self.heads, tensor_key(self.slopes))

    def tensors(self) -> list[torch.Tensor]:
        return [self.slopes]

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return (q + off - kv) == (q + off - kv)  # all True, broadcast to (..., nq, nk)

    def bias(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        distance = (q + off - kv).abs()  # q stands at key position q + off
        return -self.slopes[h] * distance  # float64; a backend casts it to q's dtype

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        every = torch.ones(q_lo.shape[0], k_lo.shape[1], dtype=torch.bool, device=q_lo.device)
        return every[None, None], every[None, None]

    def __repr__(self) -> str:
        return f"alibi({self.heads})"


def alibi(num_heads: int, *, device: torch.device | str | None = None) -> MaskSpec:
    """ALiBi (Press et al.): a mask spec that allows every pair and biases the scores.

    Query ``i`` of ``L`` stands at key position ``i + S - L`` (end-aligned, as every spec);
    head ``h`` adds ``-slope_h * |i + S - L - j|`` to the scaled score of key ``j``
    (:func:`alibi_slopes`). For a decoder combine it with the causal rule,
    ``alibi(H) & causal()``: then the distance is never negative and the bias is the paper's
    ``-slope_h * (i - j)``. A backend that takes specs adds the bias block by block, never
    building ``L x S``; the others get one float mask ``(1, H, L, S)`` of q's dtype (-inf where
    blocked). ALiBi combines with ``&`` only (not ``|`` or ``~``), and needs ``H`` query heads.

    >>> import attnkit
    >>> from attnkit.masks import alibi, causal
    >>> q = k = v = torch.randn(1, 4, 6, 8)
    >>> attnkit.attention(q, k, v, mask=alibi(4) & causal()).shape
    torch.Size([1, 4, 6, 8])
    """
    alibi_slopes(num_heads)  # validates num_heads
    return _ALiBi(num_heads, device)


def split_alibi(spec: MaskSpec) -> tuple[torch.Tensor, MaskSpec | None] | None:
    """ALiBi's slopes ``(H,)`` and the rule it is ``&``-ed with, for a spec whose only score
    bias is one :func:`alibi` joined by ``&`` (``alibi(H) & causal() & sliding_window(w)``, in
    any order); the rule is ``None`` for ``alibi(H)`` alone (every pair allowed). Anything else
    with a bias (two ALiBis, an ALiBi under ``|``, ``~`` or a head slice) gives ``None``.

    >>> from attnkit.masks import causal
    >>> slopes, rule = split_alibi(alibi(2) & causal())
    >>> slopes.tolist(), rule
    ([0.0625, 0.00390625], causal())
    >>> split_alibi(causal()) is None
    True
    """
    if isinstance(spec, _ALiBi):
        return spec.slopes, None
    if not isinstance(spec, _And) or spec.a.has_bias == spec.b.has_bias:
        return None
    biased, other = (spec.a, spec.b) if spec.a.has_bias else (spec.b, spec.a)
    parts = split_alibi(biased)
    if parts is None:
        return None
    slopes, rule = parts
    return slopes, other if rule is None else rule & other
