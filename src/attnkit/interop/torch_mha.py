"""The boundary with ``torch.nn.MultiheadAttention``: weights both ways, its masks, its call.

torch's masks say True = *ignore* (``key_padding_mask``, bool ``attn_mask``); attnkit's say
True = *may attend*. :func:`mask_from_torch` is the only place that translates one into the
other; the modules' ``key_padding_mask`` and ``attn_mask`` go through it.
:class:`TorchMultiheadAttention` (what ``MultiHeadAttention.from_torch`` returns) takes
torch's call and returns what torch returns.

Dimension legend: B batch, H heads, L query length, S key length, E model width.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnkit.errors import AttentionInputError, shape_str
from attnkit.functional import AttentionOutput
from attnkit.modules.attention import MultiHeadAttention
from attnkit.modules.kv_cache import KVCache
from attnkit.modules.masking import Mask

__all__ = ["TorchMultiheadAttention", "from_torch", "mask_from_torch", "to_torch"]


class TorchMultiheadAttention(MultiHeadAttention):
    """A :class:`~attnkit.MultiHeadAttention` called as ``nn.MultiheadAttention`` is.

    What ``MultiHeadAttention.from_torch(m)`` returns: ``m``'s weights and settings, and
    ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False)`` with torch's defaults, meanings and layout:

    - inputs ``(L, B, E)``, or ``(B, L, E)`` if ``m`` was ``batch_first``; unbatched
      ``(L, E)`` too (then ``key_padding_mask (S,)``, ``attn_mask (L, S)`` or ``(H, L, S)``);
    - ``key_padding_mask (B, S)`` and ``attn_mask (L, S)`` / ``(B * H, L, S)``: bool True =
      ignore, or float added; ``is_causal=True`` needs ``attn_mask``, which is applied;
    - returns the tuple ``(output, weights or None)``: output in the input's layout; weights
      ``(B, L, S)`` averaged over heads, or ``(B, H, L, S)`` with
      ``average_attn_weights=False`` (batch first whatever the layout, as torch's).

    The one difference: where a query has no key to attend to (a batch row all padding),
    torch gives NaN (with weights, or on its fast path); attnkit gives attention output 0
    (so the output is ``out_proj``'s bias, as torch's other path gives) and weights 0.
    attnkit's own keywords (``mask``, ``attention_mask``, ``kv_cache``, ``positions``) still
    work. Construct it with :class:`~attnkit.MultiHeadAttention`'s arguments, or with
    ``MultiHeadAttention.from_torch(m)``.

    >>> m = nn.MultiheadAttention(8, 2)
    >>> out, w = MultiHeadAttention.from_torch(m)(*[torch.randn(5, 3, 8)] * 3)
    >>> out.shape, w.shape
    (torch.Size([5, 3, 8]), torch.Size([3, 5, 5]))
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._where = "attnkit.interop.TorchMultiheadAttention"  # named so in its messages

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        mask: Mask | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> AttentionOutput:
        key = query if key is None else key
        value = key if value is None else value
        unbatched = isinstance(query, torch.Tensor) and query.dim() == 2
        if unbatched:  # torch's (L, E): a batch of one
            d = 0 if self.batch_first else 1
            same_key, same_value = key is query, value is key
            query = query.unsqueeze(d)
            key = query if same_key else _batch_of_one(key, 2, d)
            value = key if same_value else _batch_of_one(value, 2, d)
            if key_padding_mask is not None:
                key_padding_mask = _batch_of_one(key_padding_mask, 1, 0)
            if attention_mask is not None:
                attention_mask = _batch_of_one(attention_mask, 1, 0)
        out = super().forward(
            query,
            key,
            value,
            mask=mask,
            key_padding_mask=key_padding_mask,
            attention_mask=attention_mask,
            attn_mask=attn_mask,
            is_causal=is_causal,
            need_weights=need_weights,
            average_attn_weights=average_attn_weights,
            kv_cache=kv_cache,
            positions=positions,
        )
        if not unbatched:
            return out
        weights = None if out.weights is None else out.weights.squeeze(0)
        return AttentionOutput(out.output.squeeze(0 if self.batch_first else 1), weights)


def _batch_of_one(t: torch.Tensor, unbatched_dims: int, d: int) -> torch.Tensor:
    """``t`` with a batch dim of 1 at ``d`` when it has ``unbatched_dims`` dims, else ``t``."""
    if isinstance(t, torch.Tensor) and t.dim() == unbatched_dims:
        return t.unsqueeze(d)
    return t


def from_torch(m: nn.MultiheadAttention, *, backend: str = "auto") -> TorchMultiheadAttention:
    """A :class:`TorchMultiheadAttention` with the weights of ``m`` (see
    ``MultiHeadAttention.from_torch``)."""
    where = "attnkit.MultiHeadAttention.from_torch"
    if not isinstance(m, nn.MultiheadAttention):
        raise AttentionInputError(
            where,
            "m",
            f"`m` is a {type(m).__name__}, not an nn.MultiheadAttention.",
            got=type(m).__name__,
            expected="torch.nn.MultiheadAttention",
        )
    if m.bias_k is not None or m.add_zero_attn:
        raise AttentionInputError(
            where,
            "m",
            "add_bias_kv / add_zero_attn have no attnkit equivalent.",
            got=f"add_bias_kv={m.bias_k is not None}  add_zero_attn={m.add_zero_attn}",
            expected="an nn.MultiheadAttention built without add_bias_kv and add_zero_attn",
        )
    ref = m.out_proj.weight
    has_bias = m.in_proj_bias is not None
    mod = TorchMultiheadAttention(
        m.embed_dim,
        m.num_heads,
        kdim=m.kdim,
        vdim=m.vdim,
        bias=has_bias,
        dropout=m.dropout,
        batch_first=m.batch_first,
        backend=backend,
        device=ref.device,
        dtype=ref.dtype,
    )
    with torch.no_grad():
        if m._qkv_same_embed_dim:
            wq, wk, wv = torch.chunk(m.in_proj_weight, 3)
        else:
            wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
        for proj, w in ((mod.q_proj, wq), (mod.k_proj, wk), (mod.v_proj, wv)):
            proj.weight.copy_(w)
        if m.in_proj_bias is not None:
            for proj, b in zip(
                (mod.q_proj, mod.k_proj, mod.v_proj), torch.chunk(m.in_proj_bias, 3), strict=True
            ):
                proj.bias.copy_(b)
        out = mod.out_proj
        assert isinstance(out, nn.Linear)  # always built with an output projection here
        out.weight.copy_(m.out_proj.weight)
        if m.out_proj.bias is not None:
            out.bias.copy_(m.out_proj.bias)
    return mod.train(m.training)


def to_torch(mod: MultiHeadAttention) -> nn.MultiheadAttention:
    """An ``nn.MultiheadAttention`` with the weights of ``mod`` (see ``.to_torch()``)."""
    where = "attnkit.MultiHeadAttention.to_torch"
    E, H = mod.embed_dim, mod.num_heads
    out = mod.out_proj
    problems = []
    if mod.num_kv_heads != H:
        problems.append(f"num_kv_heads={mod.num_kv_heads} != num_heads={H}")
    if mod.head_dim * H != E or mod.v_head_dim != mod.head_dim:
        problems.append(f"head_dim={mod.head_dim}, v_head_dim={mod.v_head_dim} with E={E}")
    if not isinstance(out, nn.Linear):
        problems.append("no output projection")
    if mod.causal:
        problems.append("causal=True (torch's module has no causal setting)")
    if mod.rope is not None:
        problems.append("rope (torch's module has no rotary embedding)")
    if problems:
        raise AttentionInputError(
            where,
            "self",
            "this module has no nn.MultiheadAttention equivalent: " + "; ".join(problems) + ".",
            got=repr(mod),
            expected="num_kv_heads == num_heads, head_dim == v_head_dim == embed_dim // "
            "num_heads, an output projection, causal=False",
            fix="keep the attnkit module; torch's cannot express these settings",
        )
    assert isinstance(out, nn.Linear)
    ref = out.weight
    m = nn.MultiheadAttention(
        E,
        H,
        dropout=mod.dropout,
        bias=mod.q_proj.bias is not None,
        kdim=mod.kdim,
        vdim=mod.vdim,
        batch_first=mod.batch_first,
        device=ref.device,
        dtype=ref.dtype,
    )
    with torch.no_grad():
        weights = [mod.q_proj.weight, mod.k_proj.weight, mod.v_proj.weight]
        if m._qkv_same_embed_dim:
            m.in_proj_weight.copy_(torch.cat(weights))
        else:
            for target, w in zip(
                (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight), weights, strict=True
            ):
                target.copy_(w)
        if m.in_proj_bias is not None:
            m.in_proj_bias.copy_(torch.cat([mod.q_proj.bias, mod.k_proj.bias, mod.v_proj.bias]))
        m.out_proj.weight.copy_(out.weight)
        if m.out_proj.bias is not None:
            m.out_proj.bias.copy_(out.bias)
    return m.train(mod.training)


def mask_from_torch(
    attn_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    *,
    num_heads: int,
) -> torch.Tensor | None:
    """Translate ``nn.MultiheadAttention``'s masks into one attnkit mask.

    Args:
        attn_mask: torch's ``(L, S)`` or ``(B * H, L, S)``; bool True = *ignore*, or float
            (added to the scores).
        key_padding_mask: torch's ``(B, S)``; bool True = *ignore* (padding), or float.
        num_heads: ``H``, to unfold a ``(B * H, L, S)`` mask.

    Returns:
        An attnkit mask broadcastable to ``(B, H, L, S)``: bool True = may attend when both
        inputs are bool, else float (``-inf`` blocks); ``None`` when both are ``None``.

    >>> kpm = torch.tensor([[False, False, True]])  # torch: the third key is padding
    >>> mask_from_torch(key_padding_mask=kpm, num_heads=2).int()
    tensor([[[[1, 1, 0]]]], dtype=torch.int32)
    """
    where = "attnkit.interop.mask_from_torch"
    for name, t, ranks, shapes in (
        ("attn_mask", attn_mask, (2, 3), "(L, S) or (B * num_heads, L, S)"),
        ("key_padding_mask", key_padding_mask, (2,), "(B, S)"),
    ):
        if t is None:
            continue
        bad_dtype = t.dtype != torch.bool and not t.is_floating_point()
        if bad_dtype or t.dim() not in ranks:
            raise AttentionInputError(
                where,
                name,
                f"`{name}` is {t.dim()}-D {t.dtype}; torch's masks are bool (True = ignore) or "
                f"float (added to the scores), `{name}` {shapes}.",
                got=f"{shape_str(name, t, None)} dtype={t.dtype}",
                expected=f"a bool or float {name} {shapes}, as nn.MultiheadAttention",
                fix=f"{name}.bool() if 1 means ignore" if bad_dtype else None,
            )
    parts: list[torch.Tensor] = []
    if attn_mask is not None:
        if attn_mask.dim() == 3:
            BH, L, S = attn_mask.shape
            if BH % num_heads != 0:
                raise AttentionInputError(
                    where,
                    "attn_mask",
                    f"a 3-D attn_mask has {BH} in dim 0, not a multiple of num_heads.",
                    got=shape_str("attn_mask", attn_mask, ("B*H", "L", "S"))
                    + f"  num_heads={num_heads}",
                    expected="attn_mask (L, S) or (B * num_heads, L, S)",
                )
            attn_mask = attn_mask.view(BH // num_heads, num_heads, L, S)
        parts.append(attn_mask)
    if key_padding_mask is not None:
        parts.append(key_padding_mask[:, None, None, :])  # (B, 1, 1, S)
    if not parts:
        return None
    if all(p.dtype == torch.bool for p in parts):
        allowed = ~parts[0]
        for p in parts[1:]:
            allowed = allowed & ~p
        return allowed
    floats = [p for p in parts if p.is_floating_point()]
    dtype = floats[0].dtype
    total: torch.Tensor | None = None
    for p in parts:
        if p.dtype == torch.bool:
            p = torch.zeros(p.shape, dtype=dtype, device=p.device).masked_fill(p, float("-inf"))
        total = p if total is None else total + p
    return total
