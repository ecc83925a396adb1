"""The ``math`` backend: the readable reference, plain 4-D matmul, softmax, matmul.

This is what every seed writes by hand, and what :func:`attnkit.attention` is *equivalent to*.
It serves every call (any dtype, ``Dv != Dk``, dropout, masks) and is the only built-in backend
that returns the attention weights. On the CPU's ``fp32-upcast`` path (:mod:`attnkit.cpu`) a
bfloat16/float16 call computes in float32 and returns its output and weights in the input dtype.

Dimension legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv query heads per
key/value head, L query length, S key length, Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnkit.backends.base import Backend, Decision
from attnkit.call import AttentionCall

__all__ = ["MathBackend", "attend"]


class MathBackend(Backend):
    name = "math"
    description = "reference: matmul, softmax, matmul in plain PyTorch (returns weights)"
    priority = 10
    twice_differentiable = True  # plain torch ops: autograd differentiates them again

    def decide(self, call: AttentionCall) -> Decision:
        """Serves every call; its memory is the scores and weights ``(B, H, L, S)``: about
        three such tensors are alive at once (scores, masked scores, weights), plus the mask
        when a spec is materialised. On CUDA its rule says why the dense fallback was taken:
        every backend before it refused."""
        B, H, L, S = call.dims.B, call.dims.H, call.dims.L, call.dims.S
        dtype = call.compute_dtype
        mask = call.dense_mask_bytes()
        what = (
            f"the math backend's scores and weights (B={B}, H={H}, L={L}, S={S}) in {dtype} "
            "(about 3 such tensors at once)"
        )
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
        memory = 3 * B * H * L * S * dtype.itemsize + mask, what
        return Decision(self.name, rule=rule, memory=memory, note=note)

    def run(
        self, call: AttentionCall, plan: None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, k, v = call.q, call.k, call.v
        if call.upcast:  # fp32-upcast: no bf16/fp16 matmul on a CPU without their instructions
            q, k, v = q.float(), k.float(), v.float()
        out, weights = attend(
            q, k, v, call.dense_mask(), call.scale,
            softcap=call.softcap, sinks=call.sinks, dropout_p=call.dropout_p,
        )  # fmt: skip
        dtype = call.q.dtype  # the input dtype (out and weights were float32 on fp32-upcast)
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
    if sinks is not None:  # one more logit per head in every row's denominator
        sink = sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, L, 1)
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
