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
run in the backend's own dtype, plus a small absolute floor for dtype rounding. It is written
once, here: :func:`within_naive` asserts it, :func:`naive_bound` gives its bound, and ``FLOOR``
is the one table of floors; a test that needs another floor passes ``floor=`` and says why.
"""

from __future__ import annotations

import math

import torch

#: The absolute floor of the tolerance rule, per dtype of the naive run: a few units of the
#: dtype's rounding near 1 at the magnitudes the tests draw (values up to about 5). float16 keeps
#: 11 bits of mantissa (2**-11 = 0.0005), bfloat16 8 (2**-8 = 0.004).
FLOOR = {torch.float64: 1e-10, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}
#: The one exception, float32 computed on a CUDA GPU (tests/cuda/): its reductions sum in another
#: order than the CPU's; the CUDA tier was written with this floor and has not been run against a
#: tighter one.
CUDA_FLOAT32_FLOOR = 2e-4
#: The multiple of the naive run's error: outputs (and log-sum-exp), gradients.
OUTPUT_FACTOR, GRADIENT_FACTOR = 2.0, 3.0


def max_error(got: torch.Tensor, want: torch.Tensor, where: torch.Tensor | None = None) -> float:
    """``max |got - want|`` in float64 over the entries ``where`` selects (all when ``None``);
    0.0 when nothing is selected."""
    diff = got.detach().to(want.device, torch.float64) - want.detach().double()
    if where is not None:
        diff = diff[where]
    return diff.abs().max().item() if diff.numel() else 0.0


def floor_for(dtype: torch.dtype, device: torch.device | str = "cpu") -> float:
    """The rule's absolute floor for a result of ``dtype`` computed on ``device``."""
    if torch.device(device).type == "cuda" and dtype == torch.float32:
        return CUDA_FLOAT32_FLOOR
    return FLOOR[dtype]


def naive_bound(
    want: torch.Tensor,
    naive: torch.Tensor,
    *,
    grad: bool = False,
    where: torch.Tensor | None = None,
    floor: float | None = None,
    device: torch.device | str = "cpu",
) -> float:
    """The rule's bound: 2x (3x with ``grad``) the naive run's error against ``want`` (the
    float64 oracle), plus ``floor_for(naive.dtype, device)`` (``naive`` is the oracle run in
    the backend's dtype; ``device`` where the backend ran) or ``floor`` where a test needs
    another and says why."""
    factor = GRADIENT_FACTOR if grad else OUTPUT_FACTOR
    if floor is None:
        floor = floor_for(naive.dtype, device)
    return factor * max_error(naive, want, where) + floor


def within_naive(
    got: torch.Tensor,
    want: torch.Tensor,
    naive: torch.Tensor,
    *,
    grad: bool = False,
    where: torch.Tensor | None = None,
    floor: float | None = None,
    what: object = "",
) -> None:
    """Assert the tolerance rule: ``max |got - want| <= naive_bound(want, naive, ...)``.

    ``got`` is the backend's result, ``want`` the float64 oracle's, ``naive`` the oracle run in
    the backend's dtype; ``where`` restricts every error to the selected entries; ``what``
    names the case in the failure message.
    """
    err = max_error(got, want, where)
    bound = naive_bound(want, naive, grad=grad, where=where, floor=floor, device=got.device)
    assert err <= bound, (
        f"{what}: error {err:.3g} against the float64 oracle exceeds the bound {bound:.3g} "
        f"({'gradient' if grad else 'output'}, naive run in {naive.dtype})"
    )


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
    softmax, ``sinks (B, H, L)`` (or ``(1, H, L)``) one per row and head (a column with no value,
    dropped from the weights).
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
                per_row = (
                    sinks[h].expand(L) if sinks.dim() == 1 else sinks[min(b, len(sinks) - 1), h]
                )
                sink = per_row.to(dtype).unsqueeze(1)  # (L, 1)
                w_all = torch.softmax(torch.cat([s, sink], dim=1), dim=1)[:, :S]
                weights[b, h] = w_all
                out[b, h] = w_all @ v[b, hk]
                continue
            w = torch.softmax(s[live], dim=1)  # (rows, S)
            weights[b, h, live] = w
            out[b, h, live] = w @ v[b, hk]  # rows with nothing keep output 0
    out = out.masked_fill(nan_out[..., None], math.nan)
    return out, weights.masked_fill(nan_weights[..., None], math.nan)


def within_oracle_on(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    what: object = "",
) -> None:
    """Assert the tolerance rule for a peer's output ``out`` of ``q, k, v`` under the dense
    bool ``mask`` (``None``: none): against the float64 oracle, the bound from the naive run
    in q's dtype."""
    want = reference_attention(q, k, v, mask=mask)[0]
    naive = reference_attention(q, k, v, mask=mask, dtype=q.dtype)[0]
    within_naive(out, want, naive, what=what)
