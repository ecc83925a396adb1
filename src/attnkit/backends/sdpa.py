"""The ``sdpa`` backend: torch's fused kernels through ``F.scaled_dot_product_attention``.

It serves only calls for which torch runs a *fused* kernel (flash / memory-efficient / cuDNN),
never torch's own slow math path: :func:`check` holds torch's rules for choosing a fused kernel
on this device, and a test pins them against torch itself (``sdpa_kernel`` with the math kernel
excluded). Grouped-query heads use torch's ``enable_gqa`` (no repeated K/V in the fused kernel).

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnkit.backends import Mask
from attnkit.masks import MaskSpec, causal_mask

DESCRIPTION = "torch's fused kernels (F.scaled_dot_product_attention), never its math path"

_FUSED_DTYPES = {
    "cpu": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
    "cuda": (torch.float16, torch.bfloat16, torch.float32),  # cuda: see check()
}


def run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask,
    causal: bool,
    scale: float,
    dropout_p: float,
    return_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(mask, MaskSpec):
        raise TypeError("this backend takes dense masks; attnkit.attention materialises specs")
    L, S = q.shape[2], k.shape[2]
    # torch's is_causal is aligned to the top-left; attnkit's causal rule to the end.
    if causal and L != S:
        mask = causal_mask(L, S, device=q.device)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=causal and L == S,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out, None


def check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask,
    causal: bool,
    scale: float,
    dropout_p: float,
    return_weights: bool,
) -> str | None:
    if isinstance(mask, MaskSpec):
        raise TypeError("this backend takes dense masks; attnkit.attention materialises specs")
    if return_weights:
        return "fused kernels do not return the attention weights (return_weights=True)"
    device = q.device.type
    if device not in _FUSED_DTYPES:
        return f"no fused kernel is known for device type {device!r}"
    if q.dtype not in _FUSED_DTYPES[device]:
        return f"no fused kernel for dtype {q.dtype} on {device}"
    if q.shape[-1] != v.shape[-1]:
        return (
            f"value head dim Dv={v.shape[-1]} differs from Dk={q.shape[-1]}; "
            "torch would drop to its math path"
        )
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "q, k or v has a last dim that is not contiguous (stride != 1)"
    if device == "cpu":
        if dropout_p > 0.0:
            return "torch's fused CPU kernel has no dropout (dropout_p > 0)"
        if mask is not None and mask.requires_grad and torch.is_grad_enabled():
            return "torch's fused CPU kernel does not differentiate a float mask"
    elif device == "cuda":  # torch's own public rules (not run on the CPU-only test machine)
        params = torch.backends.cuda.SDPAParams(
            q, k, v, mask, dropout_p, causal, q.shape[1] != k.shape[1]
        )
        cuda = torch.backends.cuda
        if not (
            cuda.can_use_flash_attention(params)
            or cuda.can_use_efficient_attention(params)
            or cuda.can_use_cudnn_attention(params)
        ):
            return "torch reports no fused CUDA kernel for these arguments"
    return None
