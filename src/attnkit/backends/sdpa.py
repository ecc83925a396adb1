"""The ``sdpa`` backend: torch's fused kernels through ``F.scaled_dot_product_attention``.

It serves only calls for which torch runs a *fused* kernel (flash / memory-efficient / cuDNN),
never torch's own slow math path: its decision (:meth:`SdpaBackend.decide`) holds torch's
rules for choosing a fused kernel on this device, and a test pins them against torch itself
(``sdpa_kernel`` with the math kernel excluded). On CUDA, torch's own rules decide
(:func:`cuda_fused_kernel`).
Grouped-query heads use torch's ``enable_gqa`` (no repeated K/V in the fused kernel); on CUDA,
where torch's kernels refuse that (float32: only the memory-efficient kernel runs, and it has no
``enable_gqa``), K and V are repeated to the query heads within attnkit's memory limit.
On the CPU's ``fp32-upcast`` path (:mod:`attnkit.cpu`) a bfloat16/float16 call runs torch's
float32 kernel on float32 copies of q, k, v (torch's bf16 backward on a CPU without bf16
instructions is an order of magnitude slower); autograd keeps those copies for the backward,
so its saved tensors are float32-sized.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from attnkit.backends import nonfinite
from attnkit.backends.base import Backend, Decision
from attnkit.call import AttentionCall
from attnkit.cpu import to_float32
from attnkit.memory import exceeds, format_bytes

__all__ = ["SdpaBackend", "cuda_fused_kernel"]

_FUSED_DTYPES = {
    "cpu": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
    "cuda": (torch.float16, torch.bfloat16, torch.float32),  # cuda: see _cuda_plan()
}


class _Plan(NamedTuple):
    """How torch is called: ``is_causal`` (attnkit's end-aligned causal rule equals torch's
    top-left flag where ``L == S``) and whether the call's mask is handed over; a spec that
    allows every pair of this call (a causal window while the keys fit in it, as in decoding)
    is no mask at all, so torch takes its unmasked kernel."""

    is_causal: bool
    masked: bool
    kernel: str | None = None  #: on CUDA: the fused kernel torch picks (explain's note)
    repeat_kv: bool = False  #: on CUDA: K and V repeated to H heads (:func:`_repeated`)

    def mask(self, call: AttentionCall) -> torch.Tensor | None:
        """The mask torch is handed: ``None``, or the call's mask as one tensor."""
        return call.dense_mask() if self.masked else None


def _plan(call: AttentionCall) -> _Plan:
    spec = call.mask
    if spec is None:
        return _Plan(False, False)
    if call.causal and call.dims.L == call.dims.S:
        return _Plan(True, False)
    allows_all = not spec.from_tensor and spec.allows_all(call.dims.L, call.dims.S)
    return _Plan(False, not allows_all)


def _memory(call: AttentionCall, plan: _Plan) -> tuple[int, str] | None:
    """A mask spec handed to torch is materialised (a float mask is copied to float32 on
    ``fp32-upcast``)."""
    t = call.mask_tensor
    if call.upcast and t is not None and t.is_floating_point():
        return t.numel() * 4, "a float32 copy of the float mask (fp32-upcast)"
    nbytes = call.dense_mask_bytes() if plan.masked else 0
    if not nbytes:
        return None
    return nbytes, "materialising the mask spec for torch's fused kernel"


def _refusal(call: AttentionCall) -> str | None:
    """Why torch would take no fused kernel for the call (device-independent rules, and the
    CPU's), or ``None``."""
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
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return "q, k or v has a last dim that is not contiguous (stride != 1)"
    if device == "cpu":
        if call.dropout_p > 0.0:
            return "torch's fused CPU kernel has no dropout (dropout_p > 0)"
        if call.mask_needs_grad:
            return "torch's fused CPU kernel does not differentiate a float mask"
    return None


def _cuda_plan(call: AttentionCall, plan: _Plan, memory: tuple[int, str] | None) -> str | _Plan:
    """torch's own rules on CUDA (:func:`cuda_fused_kernel`): why no fused kernel serves the
    call, or the plan with the kernel torch picks. They read the mask, so it is materialised
    here, not above the memory limit."""
    if memory is not None and exceeds(memory[0], call.q.device) is not None:
        return f"{memory[1]} would exceed attnkit's memory limit"
    q, k, v = call.q, call.k, call.v
    mask = plan.mask(call)
    kernel = cuda_fused_kernel(q, k, v, mask, call.dropout_p, plan.is_causal, call.grouped)
    if kernel is not None:
        return plan._replace(kernel=kernel)
    if call.grouped:
        return _repeated(call, plan, mask)
    return "torch reports no fused CUDA kernel for these arguments"


def _repeated(call: AttentionCall, plan: _Plan, mask: torch.Tensor | None) -> str | _Plan:
    """Grouped-query heads torch's fused kernels refuse (``enable_gqa`` is flash's and
    cuDNN's, fp16/bf16 only): the plan that repeats K and V to the H query heads, where torch
    runs a fused kernel for that call (the memory-efficient kernel in float32) and the copies fit
    attnkit's memory limit; else why not. torch's rules are asked about a call of the same sizes
    with Hkv query heads (they read the head counts only to compare them), so nothing is
    copied to decide."""
    d = call.dims
    q = call.q.narrow(1, 0, d.Hkv)
    if mask is not None and mask.dim() == 4 and mask.shape[1] == d.H:
        mask = mask.narrow(1, 0, d.Hkv)
    kernel = cuda_fused_kernel(q, call.k, call.v, mask, call.dropout_p, plan.is_causal, False)
    if kernel is None:
        return (
            "torch reports no fused CUDA kernel for these arguments (grouped-query heads, "
            "and none with K and V repeated to the query heads)"
        )
    nbytes = _repeat_memory(call)[0]
    if exceeds(nbytes, call.q.device) is not None:
        return (
            "torch has no fused CUDA kernel for these grouped-query heads, and K and V repeated "
            f"to the {d.H} query heads ({format_bytes(nbytes)}) would exceed attnkit's memory "
            "limit"
        )
    return plan._replace(kernel=kernel, repeat_kv=True)


def _note(call: AttentionCall, plan: _Plan) -> str | None:
    notes = []
    spec = call.mask
    if spec is not None and not plan.is_causal and not plan.masked:
        notes.append(
            f"the mask allows every pair of this {call.dims.L} x {call.dims.S} call: torch "
            "runs without one"
        )
    if call.upcast:
        notes.append("runs torch's float32 fused kernel on float32 copies of q, k, v (fp32-upcast)")
    if plan.repeat_kv:
        d = call.dims
        notes.append(
            f"K and V repeated from {d.Hkv} to {d.H} heads: torch's fused kernels take "
            f"grouped-query heads only as flash and cuDNN do (fp16/bf16); its {plan.kernel} "
            "kernel serves the repeated call"
        )
    elif plan.kernel is not None:
        notes.append(f"torch runs its {plan.kernel} kernel for these arguments")
    return "; ".join(notes) or None


def _repeat_memory(call: AttentionCall) -> tuple[int, str]:
    d = call.dims
    nbytes = d.B * d.H * d.S * (d.Dk + d.Dv) * call.k.element_size()
    return nbytes, f"K and V repeated to the {d.H} query heads"


class SdpaBackend(Backend):
    name = "sdpa"
    description = "torch's fused kernels (F.scaled_dot_product_attention), never its math path"
    priority = 20
    fused = True

    def decide(self, call: AttentionCall) -> Decision:
        """Serves what torch runs a fused kernel for (:func:`_refusal`; on CUDA torch's own
        rules, :func:`cuda_fused_kernel`); its plan is how torch is called, its memory the mask
        spec materialised for torch."""
        reason = _refusal(call)
        if reason is not None:
            return Decision(self.name, reason)
        plan = _plan(call)
        memory = _memory(call, plan)
        if call.device_type == "cuda":
            cuda = _cuda_plan(call, plan, memory)
            if isinstance(cuda, str):
                return Decision(self.name, cuda)
            plan = cuda
            memory = _repeat_memory(call) if plan.repeat_kv else None  # the mask is made
        note = _note(call, plan) if call.explaining else None
        return Decision(self.name, None, None, memory, plan, note)

    def run(
        self, call: AttentionCall, plan: _Plan | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        plan = _plan(call) if plan is None else plan
        mask = plan.mask(call)
        q, k, v = call.q, call.k, call.v
        if call.upcast:
            if not call.needs_grad:  # fp32-upcast: float32 copies in (in the reused
                q, k, v = to_float32(q, k, v)  # buffer: torch is done with them on return)
            else:  # autograd keeps the copies, so they are its own
                q, k, v = q.float(), k.float(), v.float()
            if mask is not None and mask.is_floating_point():
                mask = mask.float()  # torch wants a float mask in q's dtype
        grouped = call.grouped
        if plan.repeat_kv:  # torch's fused kernels refuse these grouped-query heads
            groups = call.dims.H // call.dims.Hkv
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            grouped = False
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=call.dropout_p,
            is_causal=plan.is_causal,
            scale=call.scale,
            enable_gqa=grouped,
        )
        dtype = call.q.dtype
        return (out if out.dtype == dtype else out.to(dtype)), None

    def direct(
        self, call: AttentionCall, plan: _Plan | None = None
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None] | None:
        """Where torch gets q, k and v as they are and no mask tensor (no mask, a causal call,
        a spec that allows every pair: the layers of an encoder or a short prefill), a later
        call with the same signature (:func:`attnkit.backends.memo.direct_key`) runs
        ``F.scaled_dot_product_attention`` with this plan's arguments directly, after the
        non-finite check (:func:`attnkit.backends.nonfinite.all_finite`; ``None`` where an
        input is not finite, and the whole path applies the rule). A materialised mask, K/V
        repeated, or float32 copies (``fp32-upcast``) take the whole path every time."""
        plan = _plan(call) if plan is None else plan
        if plan.masked or plan.repeat_kv or call.upcast or call.device_type != "cpu":
            return None
        return _direct(plan, call.scale, call.grouped)


def _direct(
    plan: _Plan, scale: float | None, grouped: bool
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """The run of :meth:`SdpaBackend.direct`: the non-finite check, then torch's call."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        if not nonfinite.all_finite(q, k, v):
            return None  # the whole path: the non-finite rule (attnkit.backends.nonfinite)
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=plan.is_causal, scale=scale, enable_gqa=grouped
        )

    return run


def cuda_fused_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
) -> str | None:
    """The fused kernel torch picks for these arguments (``"flash"``, ``"efficient"``,
    ``"cudnn"``), or ``None`` where only its math path would serve them. Asked of torch itself
    (``torch._fused_sdp_choice``, the selection ``F.scaled_dot_product_attention`` runs), so
    its priority order holds: on Hopper with a recent cuDNN, cuDNN comes before flash, which
    the ``can_use_*`` checks taken one by one do not say; ``sdpa_kernel``'s settings too."""
    try:
        choice = torch._fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, enable_gqa=enable_gqa)
    except RuntimeError:  # every kernel switched off (sdpa_kernel without the math path)
        return None
    return _KERNELS.get(int(choice))


#: torch's answer (an ``SDPBackend`` value) as the kernel's name; math and error: ``None``
_KERNELS = {
    SDPBackend.FLASH_ATTENTION.value: "flash",
    SDPBackend.EFFICIENT_ATTENTION.value: "efficient",
    SDPBackend.CUDNN_ATTENTION.value: "cudnn",
    SDPBackend.OVERRIDEABLE.value: "overrideable",
}
