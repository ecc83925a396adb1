"""The float64 oracle: attention written out head by head, independent of attnkit's backends.

It loops over batch and heads, maps query head h to key/value head h // (H // Hkv) explicitly,
builds the end-aligned causal rule from indices, and zeroes rows with nothing to attend to.

Non-finite inputs follow attnkit's rule, written out: a query row holding NaN or inf, and a
query row allowed to see a key holding one, give NaN output and NaN weights; a query row allowed
to see a value holding one gives NaN output (its weights, from q and k, stay finite); every
other row is computed as if the bad entries were absent (they are zeroed first, so that a
``0 * NaN`` of a row that cannot see them never happens).

Tolerance rule used by the tests (after flash-attention's): a backend's error against this
oracle, computed in float64, must be at most 2x (outputs) / 3x (gradients) the error of a naive
run in the backend's own dtype, plus a small absolute floor for dtype rounding.
"""

from __future__ import annotations

import math

import torch


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (B, H, L, Dv) and weights (B, H, L, S), computed in ``dtype``.

    ``dtype=torch.float64`` is the oracle; a lower dtype gives the "naive run in the same
    dtype" that the tolerance rule compares against. ``softcap`` caps the scaled scores to
    ``c * tanh(s / c)`` before the mask; ``sinks (H,)`` adds one logit per head to every row's
    softmax (a column with no value, dropped from the weights).
    """
    q, k, v = (t.to(dtype) for t in (q, k, v))
    B, H, L, Dk = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = H // Hkv
    scale = 1.0 / math.sqrt(Dk) if scale is None else scale
    allowed = torch.ones(B, H, L, S, dtype=torch.bool)
    additive = torch.zeros(B, H, L, S, dtype=dtype)
    if mask is not None:
        m = mask.expand(B, H, L, S)
        if m.dtype == torch.bool:
            allowed &= m
        else:
            additive = additive + m.to(dtype)
            allowed &= m != float("-inf")
    if causal:
        i = torch.arange(L)[:, None]
        j = torch.arange(S)[None, :]
        allowed &= j <= i + (S - L)
    out = torch.zeros(B, H, L, Dv, dtype=dtype)
    weights = torch.zeros(B, H, L, S, dtype=dtype)
    bad_q = ~torch.isfinite(q).all(dim=-1)  # (B, H, L)
    bad_k = ~torch.isfinite(k).all(dim=-1)  # (B, Hkv, S)
    bad_v = ~torch.isfinite(v).all(dim=-1)  # (B, Hkv, S)
    q, k, v = (torch.where(torch.isfinite(t), t, 0.0) for t in (q, k, v))
    nan_out = torch.zeros(B, H, L, dtype=torch.bool)
    nan_weights = torch.zeros(B, H, L, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            hk = h // group
            sees_k = (allowed[b, h] & bad_k[b, hk][None, :]).any(dim=1)  # (L,)
            sees_v = (allowed[b, h] & bad_v[b, hk][None, :]).any(dim=1)
            nan_weights[b, h] = bad_q[b, h] | sees_k
            nan_out[b, h] = bad_q[b, h] | sees_k | sees_v
            s = (q[b, h] @ k[b, hk].T) * scale  # (L, S)
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            s = (s + additive[b, h]).masked_fill(~allowed[b, h], float("-inf"))
            live = allowed[b, h].any(dim=1)  # rows with something to attend to
            if sinks is not None:  # the sink column: every row has it, and it has no value
                sink = sinks[h].to(dtype).expand(L, 1)
                w_all = torch.softmax(torch.cat([s, sink], dim=1), dim=1)[:, :S]
                weights[b, h] = w_all
                out[b, h] = w_all @ v[b, hk]
                continue
            w = torch.softmax(s[live], dim=1)  # (rows, S)
            weights[b, h, live] = w
            out[b, h, live] = w @ v[b, hk]  # rows with nothing keep output 0
    out = out.masked_fill(nan_out[..., None], math.nan)
    return out, weights.masked_fill(nan_weights[..., None], math.nan)
