"""``AttentionCall``: one validated attention call, the only thing a backend is handed.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.

Every caller (:func:`attnkit.attention`, :func:`attnkit.explain`, the modules) first runs the
checks it needs (:mod:`attnkit.validate`, :mod:`attnkit.mask_checks`), then
:meth:`AttentionCall.build`, the one door in: it folds the ``causal`` flag and the mask into one
spec (:func:`attnkit.masks.as_spec`) and fixes the scale. Backends then read the call and ask
it for the form of the mask they take: :attr:`AttentionCall.mask` (a spec, for block-sparse
backends), :meth:`AttentionCall.dense_mask` (a tensor, materialised once per call) or
:attr:`AttentionCall.causal` (the bare causal rule, for kernels with a causal flag).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from attnkit.cpu import path_for, upcasts
from attnkit.masks import DenseMask, MaskSpec, as_spec, is_causal

__all__ = ["AttentionCall", "Dims", "sink_rows"]


def sink_rows(sinks: torch.Tensor) -> torch.Tensor:
    """Attention sinks as checked by :func:`attnkit.validate.check_sinks`, viewed to broadcast
    over ``(B, H, L)``: ``(H,)`` becomes ``(1, H, 1)``; ``(B, H, L)`` and ``(1, H, L)`` stay.

    >>> sink_rows(torch.zeros(4)).shape
    torch.Size([1, 4, 1])
    """
    return sinks.view(1, -1, 1) if sinks.dim() == 1 else sinks


class Dims(NamedTuple):
    """The sizes of one attention call, by dimension name."""

    B: int
    H: int
    Hkv: int
    L: int
    S: int
    Dk: int
    Dv: int


@dataclass(frozen=True)
class AttentionCall:
    """A validated call of :func:`attnkit.attention`, built by :meth:`AttentionCall.build`.

    Attributes:
        q, k, v: ``(B, H, L, Dk)``, ``(B, Hkv, S, Dk)``, ``(B, Hkv, S, Dv)``, validated.
        mask: the call's whole mask rule as one spec, the ``causal`` flag included (a mask
            tensor is a :class:`~attnkit.masks.DenseMask`); ``None``: every pair allowed.
        scale: multiplies ``q @ k^T`` (``1/sqrt(Dk)`` unless given).
        dropout_p: probability of dropping a weight (0: none).
        return_weights: the weights ``(B, H, L, S)`` are asked back.
        dims: the sizes by name.
        softcap: logit soft-cap ``c`` (Gemma 2): scores become ``c * tanh(s / c)`` before the
            mask; ``None``: none.
        sinks: attention sinks, logits that join the softmax denominator of the rows they
            belong to and add no value: ``(H,)`` (gpt-oss ``s_aux``: one per query head, for
            every row) or ``(B, H, L)`` / ``(1, H, L)`` (Inkling 2: one per query row and
            head); ``None``: none. :func:`sink_rows` gives them one form.
        explaining: built by :func:`attnkit.explain`: nothing runs, and :meth:`dense_mask`
            returns a zero-memory stand-in of the right shape and dtype.
        cpu_path: for bfloat16/float16 on the CPU, the path the backends follow
            (:mod:`attnkit.cpu`: ``native``, ``fp32-upcast`` or ``torch``); else ``None``.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: MaskSpec | None
    scale: float
    dropout_p: float
    return_weights: bool
    dims: Dims
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    explaining: bool = False
    cpu_path: str | None = None
    _dense: dict[str, torch.Tensor | None] = field(default_factory=dict, repr=False)
    #: each backend's :class:`~attnkit.backends.Decision` for this call, asked once
    #: (:func:`attnkit.backends.registry.decision`)
    _decisions: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        *,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dims: Dims,
        where: str,
        mask: torch.Tensor | MaskSpec | None = None,
        causal: bool = False,
        scale: float | None = None,
        dropout_p: float = 0.0,
        return_weights: bool = False,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        explaining: bool = False,
    ) -> AttentionCall:
        """The call of arguments already checked (``dims`` from
        :func:`attnkit.validate.check_qkv`; the mask by :func:`attnkit.mask_checks.check_mask`,
        the numbers by :func:`attnkit.validate.check_scalars`, sinks by
        :func:`attnkit.validate.check_sinks`): folds ``causal`` and the mask into one spec,
        fixes the scale (``1/sqrt(Dk)`` unless given) and the CPU path. ``explaining``: a call
        of :func:`attnkit.explain` (nothing runs). ``where`` names the caller in the errors
        this can still raise: a causal rule merged into a float mask that needs a gradient
        above the memory limit (:func:`~attnkit.masks.as_spec`), a bad ``ATTNKIT_CPU_PATH``
        (:func:`attnkit.cpu.path_for`).
        """
        call = object.__new__(cls)  # the fields set at once: a frozen dataclass's __init__
        call.__dict__.update(  # sets them one by one, a third of a decode call's build
            q=q,
            k=k,
            v=v,
            mask=as_spec(mask, causal, L=dims.L, S=dims.S, where=where),
            scale=float(scale) if scale is not None else 1.0 / math.sqrt(dims.Dk),
            dropout_p=float(dropout_p),
            return_weights=return_weights,
            dims=dims,
            softcap=float(softcap) if softcap is not None else None,
            sinks=sinks,
            explaining=explaining,
            cpu_path=path_for(q, where),
            _dense={},
            _decisions={},
        )
        return call

    @property
    def causal(self) -> bool:
        """The mask is exactly the end-aligned causal rule, nothing else."""
        return is_causal(self.mask)

    @property
    def device_type(self) -> str:
        """The device type the call runs on (``q.device.type``: ``"cpu"``, ``"cuda"``, ...).
        ``auto``'s order and the backends' device rules read it, and only it, so a test can
        show what ``auto`` does on another device by patching this one property."""
        return self.q.device.type

    @property
    def grouped(self) -> bool:
        """Grouped-query heads: ``H != Hkv``."""
        return self.q.shape[1] != self.k.shape[1]

    @property
    def upcast(self) -> bool:
        """Backends convert q, k, v to float32 and their results back (``fp32-upcast``)."""
        return upcasts(self.cpu_path)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype backends compute in: float32 on ``fp32-upcast``, else q's dtype."""
        return torch.float32 if self.upcast else self.q.dtype

    @property
    def mask_tensor(self) -> torch.Tensor | None:
        """The user's mask tensor when the mask is one (causal already merged into it)."""
        return self.mask.tensor if isinstance(self.mask, DenseMask) else None

    @property
    def needs_grad(self) -> bool:
        """Autograd will want gradients of q, k or v."""
        # no generator: this is read on every call, a decode step's included
        return torch.is_grad_enabled() and (
            self.q.requires_grad or self.k.requires_grad or self.v.requires_grad
        )

    @property
    def mask_needs_grad(self) -> bool:
        """A float mask tensor that autograd will want a gradient of: the mask itself, or a
        float mask inside a spec (``causal() & DenseMask(bias)``, a position bias that trains),
        whose bias a backend that never forms the scores' gradient would silently drop."""
        if self.mask is None or not self.mask.has_bias or not torch.is_grad_enabled():
            return False
        return any(t.requires_grad and t.is_floating_point() for t in self.mask.tensors())

    def _dense_key(self, dtype: torch.dtype | None) -> tuple[str, torch.dtype]:
        """Where :meth:`dense_mask` keeps its tensor for ``dtype``, and the dtype it means (a
        spec without a bias materialises as bool whatever the dtype: one tensor)."""
        dtype = self.compute_dtype if dtype is None else dtype
        same = dtype == self.compute_dtype or self.mask is None or not self.mask.has_bias
        return ("dense" if same else f"dense {dtype}"), dtype

    def dense_mask_bytes(self, dtype: torch.dtype | None = None) -> int:
        """The bytes :meth:`dense_mask` (with the same ``dtype``) would allocate (at most): 0
        for no mask, a user's tensor or a mask already built; else what materialising the spec
        takes (:meth:`~attnkit.masks.MaskSpec.dense_bytes`)."""
        key, dtype = self._dense_key(dtype)
        if self.mask is None or key in self._dense:
            return 0
        return self.mask.dense_bytes(self.dims.L, self.dims.S, dtype)

    def dense_mask(self, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """The mask as one tensor broadcastable to ``(B, H, L, S)``: bool (True = may attend)
        or float (added to the scores), built once per call; ``None`` for no mask.

        A user's tensor comes back unchanged; a spec is materialised with ``to_dense`` (a bias
        in ``dtype``, :attr:`compute_dtype` unless given: the math backend asks for float32
        on bfloat16/float16 calls; once for every layer of a forward where attnkit built the
        spec, :func:`attnkit.backends.owned.dense`), which refuses
        (:class:`~attnkit.AttentionMemoryError`) above attnkit's memory limit.
        """
        spec = self.mask
        if spec is None:
            return None
        if isinstance(spec, DenseMask):
            return spec.tensor
        key, dtype = self._dense_key(dtype)
        if self.explaining:  # what to_dense would return, as a zero-stride view of one element
            d = self.dims
            heads = (spec.heads or 1) if spec.has_bias else 1
            one = torch.zeros(
                (), dtype=dtype if spec.has_bias else torch.bool, device=self.q.device
            )
            return one.expand(spec.batch or 1, heads, d.L, d.S)
        if key not in self._dense:
            from attnkit.backends import owned  # (at call time: the package imports this one)

            self._dense[key] = owned.dense(spec, self.dims.L, self.dims.S, self.q.device, dtype)
        return self._dense[key]
