"""The ``math`` backend: the readable reference, plain 4-D matmul, softmax, matmul.

This is what every seed writes by hand, and what :func:`attnkit.attention` is *equivalent to*.
It serves every call (any dtype, ``Dv != Dk``, dropout, masks) and is the only built-in backend
that returns the attention weights. A bfloat16/float16 call computes in float32 on every
device and CPU path, as torch's math SDPA does (``_scaled_dot_product_attention_math``): q, k,
v (and a bias it materialises) in float32, so the scores, the softmax, the weights and P·V are
float32; the output and weights come back in the input dtype, rounded once, and autograd
returns the gradients in it. In the input dtype the scores alone lost the weights to rounding:
with logits around 30 a bfloat16 score keeps 2**-9 relative, about 0.06 absolute, and float16
overflowed (``scale=1e4``: NaN); docs/low_precision.md has the errors against float64.

Dimension legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv query heads per
key/value head, L query length, S key length, Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnkit.backends.base import Backend, Decision
from attnkit.call import AttentionCall, sink_rows

__all__ = ["MathBackend", "attend", "compute_dtype"]

#: the dtypes the math backend computes in float32 (and returns in)
LOW = (torch.bfloat16, torch.float16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the math backend computes a call on ``dtype`` in: float32 for bfloat16 and
    float16 (torch's math SDPA does the same), else ``dtype`` itself."""
    return torch.float32 if dtype in LOW else dtype


class MathBackend(Backend):
    name = "math"
    description = "reference: matmul, softmax, matmul in plain PyTorch (returns weights)"
    priority = 10
    twice_differentiable = True  # plain torch ops: autograd differentiates them again

    def decide(self, call: AttentionCall) -> Decision:
        """Serves every call; its memory is the scores and weights ``(B, H, L, S)`` in
        :func:`compute_dtype` (float32 for bfloat16/float16): about three such tensors are
        alive at once (scores, masked scores, weights), one more in the input dtype when a
        low-precision call returns its weights, plus the mask when a spec is materialised. On
        CUDA its rule says why the dense fallback was taken: every backend before it
        refused."""
        B, H, L, S = call.dims.B, call.dims.H, call.dims.L, call.dims.S
        dtype = compute_dtype(call.q.dtype)
        mask = call.dense_mask_bytes(dtype)
        what = (
            f"the math backend's scores and weights (B={B}, H={H}, L={L}, S={S}) in {dtype} "
            "(about 3 such tensors at once)"
        )
        n = B * H * L * S
        returned = n * call.q.dtype.itemsize if call.return_weights and dtype != call.q.dtype else 0
        if returned:
            what += f", the weights returned in {call.q.dtype}"
        if mask:
            what += " and the mask spec materialised"
        rule = None
        if call.device_type == "cuda":
            rule = (
                True,
                (
                    "the dense fallback, taken only because no fused backend can serve this call "
                    "(their reasons are below): it builds the (B, H, L, S) weights"
                ),
            )
        note = None
        if call.explaining and call.upcast:
            note = "computes in float32 on float32 copies of q, k, v (fp32-upcast)"
        elif call.explaining and dtype != call.q.dtype:
            note = (
                "computes in float32 on float32 copies of q, k, v, as torch's math SDPA does "
                f"(scores, softmax, weights, P·V), and returns {call.q.dtype}"
            )
        memory = 3 * n * dtype.itemsize + returned + mask, what
        return Decision(self.name, rule=rule, memory=memory, note=note)

    def run(
        self, call: AttentionCall, plan: None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # bfloat16/float16 in float32 (module text): the copies are what autograd saves, and
        # its .to() returns the gradients in the input dtype
        c = compute_dtype(call.q.dtype)
        q, k, v = call.q.to(c), call.k.to(c), call.v.to(c)
        out, weights = attend(
            q, k, v, call.dense_mask(c), call.scale,
            softcap=call.softcap, sinks=call.sinks, dropout_p=call.dropout_p,
        )  # fmt: skip
        dtype = call.q.dtype  # the input dtype, rounded to once
        weights_out = weights.to(dtype) if call.return_weights else None
        return out.to(dtype), weights_out


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The math backend's computation: ``out (B, H, L, Dv)`` and ``weights (B, H, L, S)``,
    in q's dtype, from plain torch ops (so autograd differentiates it any number of times).
    It computes in the dtype it is given: :meth:`MathBackend.run` hands it float32 copies of
    bfloat16/float16 tensors (:func:`compute_dtype`), as the second derivatives do.

    ``mask`` broadcasts to ``(B, H, L, S)``: bool (True = may attend), float (added to the
    scores) or ``None``; ``softcap``, ``sinks`` and ``dropout_p`` as in
    :func:`attnkit.attention`. Nothing is validated. A query row with nothing to attend to
    gives weights, output and gradient 0. The backends' second derivatives
    (:mod:`attnkit.backends.second_order`) are this function's.
    """
    B, H, L, Dk = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv
    # Grouped-query heads without copying K/V: the G query heads of one key/value head are
    # stacked along the length, so one matmul per key/value head serves all of them.
    qg = q.reshape(B, Hkv, G * L, Dk)  # (B, Hkv, G*L, Dk)
    scores = (qg @ k.transpose(-2, -1)).view(B, H, L, S) * scale  # (B, H, L, S)
    if softcap is not None:  # Gemma 2's logit soft-cap, before the mask
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    if sinks is not None:  # one more logit in every row's denominator (per head or per row)
        sink = sink_rows(sinks).to(scores.dtype).unsqueeze(-1).expand(B, H, L, 1)
        weights = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :S]
    else:
        # A query row with nothing to attend to is all -inf; softmax would give NaN. Give
        # it scores of 0 (finite), then zero its weights: its output and gradient are 0.
        row_ok = (scores > float("-inf")).any(dim=-1, keepdim=True)  # (B, H, L, 1)
        weights = torch.where(row_ok, scores, 0.0).softmax(dim=-1)  # (B, H, L, S)
        weights = torch.where(row_ok, weights, 0.0)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = weights.view(B, Hkv, G * L, S) @ v  # (B, Hkv, G*L, Dv)
    return out.view(B, H, L, Dv), weights
