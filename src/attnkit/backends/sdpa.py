"""The ``sdpa`` backend: torch's fused kernels through ``F.scaled_dot_product_attention``.

It serves only calls for which torch runs a *fused* kernel (flash / memory-efficient / cuDNN),
never torch's own slow math path: :meth:`SdpaBackend.check` holds torch's rules for choosing a
fused kernel on this device, and a test pins them against torch itself (``sdpa_kernel`` with the
math kernel excluded). On CUDA, torch's own rules decide (:func:`cuda_fused_kernel`).
Grouped-query heads use torch's ``enable_gqa`` (no repeated K/V in the fused kernel).
On the CPU's ``fp32-upcast`` path (:mod:`attnkit.cpu`) a bfloat16/float16 call runs torch's
float32 kernel on float32 copies of q, k, v (torch's bf16 backward on a CPU without bf16
instructions is an order of magnitude slower); autograd keeps those copies for the backward,
so its saved tensors are float32-sized.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnkit.backends.base import Backend
from attnkit.call import AttentionCall
from attnkit.cpu import to_float32
from attnkit.memory import exceeds

__all__ = ["SdpaBackend", "cuda_fused_kernel"]

_FUSED_DTYPES = {
    "cpu": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
    "cuda": (torch.float16, torch.bfloat16, torch.float32),  # cuda: see check()
}


def _flag_and_mask(call: AttentionCall) -> tuple[bool, torch.Tensor | None]:
    """torch's ``is_causal`` is aligned to the top-left, attnkit's causal rule to the end: the
    flag serves ``L == S`` only. A spec that allows every pair of this call (a causal window
    while the keys fit in it, as in decoding) is no mask at all, so torch takes its unmasked
    kernel; any other mask is handed over as one tensor."""
    if call.causal and call.dims.L == call.dims.S:
        return True, None
    if _allows_all(call):
        return False, None
    return False, call.dense_mask()


def _allows_all(call: AttentionCall) -> bool:
    spec = call.mask
    return spec is not None and not spec.from_tensor and spec.allows_all(call.dims.L, call.dims.S)


class SdpaBackend(Backend):
    name = "sdpa"
    description = "torch's fused kernels (F.scaled_dot_product_attention), never its math path"
    priority = 20
    fused = True

    def run(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        is_causal, mask = _flag_and_mask(call)
        q, k, v = call.q, call.k, call.v
        if call.upcast and not call.needs_grad:  # fp32-upcast: float32 copies in (in the
            q, k, v = to_float32(q, k, v)  # reused buffer: torch is done with them on return)
        elif call.upcast:  # autograd keeps the copies, so they are its own
            q, k, v = q.float(), k.float(), v.float()
        if call.upcast and mask is not None and mask.is_floating_point():
            mask = mask.float()  # torch wants a float mask in q's dtype
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=call.dropout_p,
            is_causal=is_causal,
            scale=call.scale,
            enable_gqa=call.grouped,
        )
        return out.to(call.q.dtype), None

    def note(self, call: AttentionCall) -> str | None:
        notes = []
        if _allows_all(call):
            notes.append(
                f"the mask allows every pair of this {call.dims.L} x {call.dims.S} call: torch "
                "runs without one"
            )
        if call.upcast:
            notes.append(
                "runs torch's float32 fused kernel on float32 copies of q, k, v (fp32-upcast)"
            )
        return "; ".join(notes) or None

    def dense_allocation(self, call: AttentionCall) -> tuple[int, str] | None:
        """A mask spec (other than causal with ``L == S``) is materialised for torch."""
        flag = call.causal and call.dims.L == call.dims.S
        nbytes = 0 if flag or _allows_all(call) else call.dense_mask_bytes()
        t = call.mask_tensor
        if call.upcast and t is not None and t.is_floating_point():
            return t.numel() * 4, "a float32 copy of the float mask (fp32-upcast)"
        if not nbytes:
            return None
        return nbytes, "materialising the mask spec for torch's fused kernel"

    def check(self, call: AttentionCall) -> str | None:
        q, k, v = call.q, call.k, call.v
        if call.return_weights:
            return "fused kernels do not return the attention weights (return_weights=True)"
        if call.softcap is not None or call.sinks is not None:
            return "torch's fused kernels have no logit soft-cap or attention sinks"
        device = call.device_type
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
            if call.dropout_p > 0.0:
                return "torch's fused CPU kernel has no dropout (dropout_p > 0)"
            if call.mask_needs_grad:
                return "torch's fused CPU kernel does not differentiate a float mask"
        elif device == "cuda":  # torch's own public rules (not run on the CPU-only test machine)
            need = self.dense_allocation(call)
            if need is not None and exceeds(need[0], q.device) is not None:
                # torch's rules read the mask: it is not materialised above the memory limit
                return f"{need[1]} would exceed attnkit's memory limit"
            is_causal, mask = _flag_and_mask(call)
            if cuda_fused_kernel(q, k, v, mask, call.dropout_p, is_causal, call.grouped) is None:
                what = " (grouped-query heads)" if call.grouped else ""
                return f"torch reports no fused CUDA kernel for these arguments{what}"
        return None


def cuda_fused_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
) -> str | None:
    """The fused CUDA kernel torch's own rules pick for these arguments (``"flash"``,
    ``"efficient"``, ``"cudnn"``), or ``None`` when only its math path would serve them."""
    params = torch.backends.cuda.SDPAParams(q, k, v, mask, dropout_p, is_causal, enable_gqa)
    cuda = torch.backends.cuda
    for name, can in (
        ("flash", cuda.can_use_flash_attention),
        ("efficient", cuda.can_use_efficient_attention),
        ("cudnn", cuda.can_use_cudnn_attention),
    ):
        if can(params):
            return name
    return None
