"""Positions: rotary embeddings (RoPE), ALiBi as a mask spec with a score bias, learned positions.

Dimension legend: B batch, H heads, L length, D head dim, E model width, P max positions;
``m``, ``n`` are token positions.

- :class:`RotaryEmbedding` rotates each pair of dims of q and k by an angle ``m * theta_i``, so
  that ``q_m . k_n`` depends on ``m - n`` only. Two layouts of the pairs: ``"half"`` pairs dim
  ``i`` with ``i + D/2`` (GPT-NeoX, Llama), ``"interleaved"`` pairs ``2i`` with ``2i + 1``
  (RoFormer, GPT-J).
- :func:`alibi` is a :class:`~attnkit.masks.MaskSpec` that allows every pair and adds
  ``-slope_h * |distance|`` to the scores; backends that take specs evaluate it block by block,
  the others get it materialised as a float mask. Causal ALiBi is ``alibi(H) & causal()``.
- :class:`LearnedPositions` is a table ``(P, E)`` indexed by position (GPT-2, BERT).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from attnkit.errors import (
    AttentionInputError,
    check_dtype_arg,
    check_int,
    dtype_error,
    is_int_tensor,
    shape_str,
    tensor_got,
)
from attnkit.masks import alibi, alibi_slopes
from attnkit.validate import can_read_values, is_real

__all__ = ["LearnedPositions", "RotaryEmbedding", "alibi", "alibi_slopes"]

RopeLayout = Literal["half", "interleaved"]


def _positions(
    where: str, positions: torch.Tensor | None, B: int, L: int, device: torch.device
) -> torch.Tensor:
    """``positions`` as ``(B', L)`` integers (``B'`` 1 or B); ``None`` is ``0 .. L-1``."""
    if positions is None:
        return torch.arange(L, device=device)[None]  # (1, L)
    if (
        not is_int_tensor(positions)
        or positions.dim() not in (1, 2)
        or positions.shape[-1] != L
        or (positions.dim() == 2 and positions.shape[0] not in (1, B))
    ):
        raise AttentionInputError(
            where,
            "positions",
            "`positions` must be integer positions (L,) or (B, L) matching the input.",
            got=f"{tensor_got('positions', positions, None)}  input (B={B}, L={L})",
            expected=f"an integer tensor of shape ({L},) or ({B}, {L})",
            fix="torch.arange(L) + offset, e.g. the number of tokens already in the KV cache",
        )
    return positions if positions.dim() == 2 else positions[None]


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE) for q or k ``(B, H, L, D)``.

    Pair ``i`` (of ``dim / 2``) of the token at position ``m`` is rotated by the angle
    ``(m / scaling) * base ** (-2i / dim)``::

        [x_a']   [cos  -sin] [x_a]
        [x_b'] = [sin   cos] [x_b]

    where ``(a, b) = (i, i + dim/2)`` in the ``"half"`` layout and ``(2i, 2i + 1)`` in the
    ``"interleaved"`` one. Only the first ``dim`` dims of the head are rotated (``dim`` may be
    less than the head dim: partial rotary, as GPT-J and GPT-NeoX); the rest pass through.

    Args:
        dim: rotated dims per head, even.
        base: the frequency base (10000 in the paper; larger bases for long contexts).
        layout: ``"half"`` (GPT-NeoX, Llama) or ``"interleaved"`` (RoFormer, GPT-J).
        scaling: **linear position scaling** (position interpolation): positions are divided
            by ``scaling`` before the angles are taken, so a model trained on ``P`` positions
            covers ``scaling * P``. ``1.0`` is plain RoPE.

    ``forward(x, positions=None)``: ``x (B, H, L, D)`` with ``D >= dim``; ``positions (L,)``
    or ``(B, L)`` integers (default ``0 .. L-1``; with a KV cache, the cached length plus
    ``0 .. L-1``). Angles are computed in float32 (float64 for float64 input) and the result
    has ``x``'s dtype.

    >>> rope = RotaryEmbedding(8, layout="half")
    >>> q = torch.randn(1, 2, 5, 8)
    >>> rope(q).shape
    torch.Size([1, 2, 5, 8])
    >>> torch.equal(rope(q)[:, :, 0], q[:, :, 0])  # position 0 is not rotated
    True
    """

    inv_freq: torch.Tensor

    def __init__(
        self,
        dim: int,
        *,
        base: float = 10000.0,
        layout: RopeLayout = "half",
        scaling: float = 1.0,
    ) -> None:
        super().__init__()
        where = "attnkit.RotaryEmbedding"
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
            raise AttentionInputError(
                where,
                "dim",
                "`dim` must be an even int >= 2.",
                got=f"dim={dim!r}",
                expected="2, 4, ...",
            )
        if layout not in ("half", "interleaved"):
            raise AttentionInputError(
                where,
                "layout",
                f"unknown layout {layout!r}.",
                got=f"layout={layout!r}",
                expected="'half' (dims i, i + dim/2; GPT-NeoX, Llama) or 'interleaved' "
                "(dims 2i, 2i+1; RoFormer, GPT-J)",
            )
        for name, value in (("base", base), ("scaling", scaling)):
            if not is_real(value) or not math.isfinite(value) or not value > 0:
                raise AttentionInputError(
                    where,
                    name,
                    f"`{name}` must be a finite number > 0.",
                    got=f"{name}={value!r}",
                    expected="a finite number > 0 (an infinite one rotates nothing)",
                )
        self.dim = dim
        self.base = float(base)
        self.layout: RopeLayout = layout
        self.scaling = float(scaling)
        exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim  # (dim/2,)
        self.register_buffer("inv_freq", self.base**-exponents, persistent=False)  # float64

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, layout={self.layout!r}, scaling={self.scaling}"

    def angles(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``positions (..., L)`` -> angles ``(..., L, dim/2)`` in ``dtype``."""
        pos = positions.to(torch.float64) / self.scaling
        return (pos[..., None] * self.inv_freq.to(pos.device)).to(dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        where = "attnkit.RotaryEmbedding"
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[-1] < self.dim:
            got = shape_str("x", x, ("B", "H", "L", "D")) if isinstance(x, torch.Tensor) else "?"
            raise AttentionInputError(
                where,
                "x",
                f"RoPE takes q or k as (B, H, L, D) with D >= dim = {self.dim}.",
                got=got,
                expected=f"x (B, H, L, D >= {self.dim})",
                fix="split heads first: attnkit.split_heads(x, num_heads)",
            )
        got = f"{shape_str('x', x, ('B', 'H', 'L', 'D'))} dtype={x.dtype}"
        if x.is_floating_point() or x.is_complex():  # float8, complex: not computed in
            error = dtype_error(where, "x", x.dtype, got)
            if error is not None:
                raise error
        else:
            raise AttentionInputError(
                where,
                "x",
                f"RoPE rotates float vectors; x has dtype {x.dtype}, in which every rotated "
                "value would be rounded to an integer.",
                got=got,
                expected="x (B, H, L, D) float32, float64, bfloat16 or float16",
                fix="x.float()",
            )
        B, _, L, _ = x.shape
        pos = _positions(where, positions, B, L, x.device)  # (B', L)
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        theta = self.angles(pos, dtype)[:, None]  # (B', 1, L, dim/2)
        cos, sin = theta.cos().to(x.dtype), theta.sin().to(x.dtype)
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        if self.layout == "half":
            a, b = rot.chunk(2, dim=-1)  # (B, H, L, dim/2) each
            out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        else:
            a, b = rot[..., 0::2], rot[..., 1::2]  # (B, H, L, dim/2) each
            out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


class LearnedPositions(nn.Module):
    """Learned absolute positions: a table ``weight (P, E)``; ``positions -> (..., E)``.

    ``forward(positions)`` takes integer positions of any shape (usually ``(L,)`` or
    ``(B, L)``) and returns their rows; a position ``>= P`` raises an
    :class:`~attnkit.AttentionInputError` instead of an index error.

    >>> pe = LearnedPositions(16, 8)
    >>> pe(torch.arange(5)).shape
    torch.Size([5, 8])
    """

    def __init__(
        self,
        max_positions: int,
        dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_int("attnkit.LearnedPositions", "max_positions", max_positions)
        check_int("attnkit.LearnedPositions", "dim", dim)
        check_dtype_arg("attnkit.LearnedPositions", dtype)
        self.max_positions = max_positions
        self.dim = dim
        self.weight = nn.Parameter(torch.empty(max_positions, dim, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)

    def extra_repr(self) -> str:
        return f"max_positions={self.max_positions}, dim={self.dim}"

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        where = "attnkit.LearnedPositions"
        if not is_int_tensor(positions):
            raise AttentionInputError(
                where,
                "positions",
                "`positions` must be a tensor of integer positions.",
                got=tensor_got("positions", positions, None),
                expected="an int64 tensor of positions 0 .. max_positions - 1",
                fix="torch.arange(L), or positions.long() if they are whole numbers",
            )
        if positions.numel() and can_read_values(positions) and int(positions.min()) < 0:
            raise AttentionInputError(
                where,
                "positions",
                f"position {int(positions.min())} is negative.",
                got=f"{shape_str('positions', positions, None)} min={int(positions.min())}",
                expected="positions >= 0",
                fix="count positions from 0 (a left-padded row: from its first real token)",
            )
        if (
            positions.numel()
            and can_read_values(positions)  # not while torch.compile traces: no data branch
            and int(positions.max()) >= self.max_positions
        ):
            raise AttentionInputError(
                "attnkit.LearnedPositions",
                "positions",
                f"position {int(positions.max())} is past the table's {self.max_positions} "
                "positions.",
                got=f"{shape_str('positions', positions, None)} max={int(positions.max())}",
                expected=f"positions < max_positions = {self.max_positions}",
                fix="shorten the input (prompt + new tokens), or build a larger table",
            )
        return nn.functional.embedding(positions, self.weight)
