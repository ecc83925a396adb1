"""``attention()`` and ``explain()``: validate -> prepare the mask -> choose a backend -> run.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple, overload

import torch

from attnkit.backends import AUTO_ORDER, Backend, available_backends, get_backend
from attnkit.errors import AttentionInputError
from attnkit.inspect.tracing import _ACTIVE as _TRACES
from attnkit.masks import MaskSpec, causal_mask
from attnkit.masks import causal as causal_spec
from attnkit.validate import Dims, validate_attention

__all__ = ["AttentionOutput", "Explanation", "attention", "explain"]

WHERE = "attnkit.attention"


class AttentionOutput(NamedTuple):
    """Output and weights together; unpacks as ``out, weights = ...``.

    ``output`` is ``(B, H, L, Dv)`` from :func:`attention` and ``(B, L, E)`` from the modules;
    ``weights`` is ``(B, H, L, S)`` when asked for, else ``None``.
    """

    output: torch.Tensor
    weights: torch.Tensor | None


@dataclass(frozen=True)
class _Call:
    """A validated call with its mask prepared for the backends."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | MaskSpec | None
    causal: bool
    scale: float
    dropout_p: float
    return_weights: bool
    dims: Dims
    #: True for :func:`explain`: a backend that takes dense masks is shown a stand-in of the
    #: materialised spec (its shape, dtype and device, no memory), never the L x S mask itself
    stand_in: bool = False
    _dense: dict[str, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, backend: Backend) -> torch.Tensor | MaskSpec | None:
        """The mask as ``backend`` takes it: a spec, or the spec materialised once."""
        if not isinstance(self.mask, MaskSpec) or backend.takes_specs:
            return self.mask
        if self.stand_in:  # what to_dense would return, as a zero-stride view of one element
            spec, d = self.mask, self.dims
            dtype = self.q.dtype if spec.has_bias else torch.bool
            heads = (spec.heads or 1) if spec.has_bias else 1
            one = torch.zeros((), dtype=dtype, device=self.q.device)
            return one.expand(spec.batch or 1, heads, d.L, d.S)
        if "dense" not in self._dense:
            self._dense["dense"] = self.mask.to_dense(
                self.dims.L, self.dims.S, device=self.q.device, dtype=self.q.dtype
            )
        return self._dense["dense"]

    def check(self, backend: Backend) -> str | None:
        return backend.check(
            self.q,
            self.k,
            self.v,
            mask=self.mask_for(backend),
            causal=self.causal,
            scale=self.scale,
            dropout_p=self.dropout_p,
            return_weights=self.return_weights,
        )

    def rule(self, backend: Backend) -> tuple[bool, str]:
        """``(fires, why)`` of the backend's auto rule; a backend without one always fires."""
        if backend.rule is None:
            return True, f"the first in auto's order ({' > '.join(AUTO_ORDER)}) that can serve"
        return backend.rule(
            self.q,
            self.k,
            self.v,
            mask=self.mask_for(backend),
            causal=self.causal,
            scale=self.scale,
            dropout_p=self.dropout_p,
            return_weights=self.return_weights,
        )

    def note(self, backend: Backend) -> str | None:
        if backend.note is None:
            return None
        return backend.note(
            self.q,
            self.k,
            self.v,
            mask=self.mask_for(backend),
            causal=self.causal,
            scale=self.scale,
            dropout_p=self.dropout_p,
            return_weights=self.return_weights,
        )


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | MaskSpec | None,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    return_weights: bool,
    where: str,
) -> _Call:
    dims = validate_attention(q, k, v, mask, causal, scale, dropout_p, return_weights, where=where)
    if isinstance(mask, MaskSpec):  # a spec absorbs the causal flag; causal() alone is the flag
        if causal:
            mask = mask & causal_spec()
        elif type(mask) is type(causal_spec()):
            mask, causal = None, True
        causal = causal and mask is None
    if causal and mask is None and dims.L == 1:  # one query (a decode step) sees every key
        causal = False
    # Backends get the causal rule alone, or one mask: causal + mask (which torch refuses) and
    # causal with L > S (whose first L - S rows see nothing) become one end-aligned mask.
    if causal and (mask is not None or dims.L > dims.S):
        allowed = causal_mask(dims.L, dims.S, device=q.device)  # (L, S)
        if mask is None:
            mask = allowed
        elif isinstance(mask, MaskSpec):
            raise AssertionError("unreachable: specs absorbed the causal flag above")
        elif mask.dtype == torch.bool:
            mask = mask & allowed
        else:
            mask = mask.masked_fill(~allowed, float("-inf"))
        causal = False
    return _Call(
        q,
        k,
        v,
        mask,
        causal,
        float(scale) if scale is not None else 1.0 / math.sqrt(dims.Dk),
        float(dropout_p),
        return_weights,
        dims,
    )


def _choose(call: _Call, backend: str, where: str) -> Backend:
    if backend == "auto":
        for name in AUTO_ORDER:
            chosen = get_backend(name)
            if (chosen.rule is None or call.rule(chosen)[0]) and call.check(chosen) is None:
                return chosen
        raise AttentionInputError(  # unreachable while `math` serves every call
            where,
            "backend",
            "no registered backend can serve this call.",
            got=f"backends tried: {', '.join(AUTO_ORDER)}",
            expected="at least one backend that serves the call",
            fix="attnkit.explain(...) with the same arguments lists each backend's reason",
        )
    if not isinstance(backend, str) or backend not in available_backends():
        raise AttentionInputError(
            where,
            "backend",
            f"unknown backend {backend!r}.",
            got=f"backend={backend!r}",
            expected=f"'auto' or one of {available_backends()}",
            fix="backend='auto' picks the fastest backend that can serve the call",
        )
    chosen = get_backend(backend)
    reason = call.check(chosen)
    if reason is not None:
        raise AttentionInputError(
            where,
            "backend",
            f"backend {backend!r} cannot serve this call: {reason}.",
            got=f"backend={backend!r}",
            expected="a backend that can serve the call (attnkit never falls back silently)",
            fix="backend='auto' takes one that can; attnkit.explain(...) shows why",
        )
    return chosen


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | MaskSpec | None = ...,
    causal: bool = ...,
    scale: float | None = ...,
    dropout_p: float = ...,
    return_weights: Literal[False] = ...,
    backend: str = ...,
) -> torch.Tensor: ...


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | MaskSpec | None = ...,
    causal: bool = ...,
    scale: float | None = ...,
    dropout_p: float = ...,
    return_weights: Literal[True],
    backend: str = ...,
) -> AttentionOutput: ...


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | MaskSpec | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
) -> torch.Tensor | AttentionOutput:
    """Scaled dot-product attention, the one entry point of attnkit.

    Args:
        q: queries ``(B, H, L, Dk)``.
        k: keys ``(B, Hkv, S, Dk)``. ``H % Hkv == 0``: query head ``h`` uses key/value head
            ``h // (H // Hkv)`` (grouped-query; ``Hkv == 1`` is multi-query). K/V are not copied.
        v: values ``(B, Hkv, S, Dv)``; ``Dv`` may differ from ``Dk``.
        mask: broadcastable to ``(B, H, L, S)``. Bool: **True = may attend** (as in
            ``F.scaled_dot_product_attention``; the opposite of ``nn.MultiheadAttention``'s
            masks). Float (q's dtype): added to the scaled scores, ``-inf`` blocks. Or a spec
            from :mod:`attnkit.masks` (``causal() & sliding_window(256)``, ``padding(lengths)``,
            ...), which block-sparse backends evaluate per block and the others materialise.
        causal: query ``i`` attends to keys ``j <= i + S - L``, aligned to the *end* when
            ``L != S`` (what KV-cache decoding needs). With ``L = 2, S = 4``::

                1 1 1 0
                1 1 1 1

            May be combined with ``mask`` (both must allow a pair).
        scale: multiplies ``q @ k^T``; default ``1 / sqrt(Dk)``.
        dropout_p: probability of dropping an attention weight. Applied whenever it is > 0, so
            pass ``p if self.training else 0.0`` from a module (attnkit's modules do).
        return_weights: also return the weights ``(B, H, L, S)`` (after dropout).
        backend: ``"auto"`` (the fastest backend that can serve the call, see
            :func:`explain`), or a name from :func:`attnkit.available_backends`. A named backend
            that cannot serve the call raises; attnkit never falls back silently.

    Returns:
        ``(B, H, L, Dv)``; with ``return_weights=True`` an :class:`AttentionOutput`
        ``(output, weights)``. A query row with nothing to attend to gives output 0 and
        gradient 0, never NaN.

    Equivalent to (the ``math`` backend, shown for ``H == Hkv``)::

        scores = q @ k.transpose(-2, -1) * scale           # (B, H, L, S)
        scores = scores.masked_fill(~mask, float("-inf"))  # bool mask; a float mask is added
        weights = scores.softmax(dim=-1)                   # (B, H, L, S)
        out = weights @ v                                  # (B, H, L, Dv)

    Raises:
        AttentionInputError: bad input, with the argument, the shapes and the likely fix.

    >>> q = torch.randn(2, 8, 5, 16); k = v = torch.randn(2, 2, 7, 16)
    >>> attention(q, k, v, causal=True).shape
    torch.Size([2, 8, 5, 16])
    """
    result = run_attention(q, k, v, mask, causal, scale, dropout_p, return_weights, backend)
    return result if return_weights else result.output


def run_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | MaskSpec | None,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    return_weights: bool,
    backend: str,
    where: str = WHERE,
) -> AttentionOutput:
    """:func:`attention` with one return type, for the modules: always ``(output, weights)``."""
    call = _prepare(q, k, v, mask, causal, scale, dropout_p, return_weights, where)
    chosen = _choose(call, backend, where)
    out, weights = chosen.run(
        call.q,
        call.k,
        call.v,
        mask=call.mask_for(chosen),
        causal=call.causal,
        scale=call.scale,
        dropout_p=call.dropout_p,
        return_weights=call.return_weights,
    )
    if _TRACES:  # attnkit.trace() is active: record shapes (nothing is computed)
        from attnkit.inspect.tracing import record_attention

        record_attention(_TRACES[-1], call.q, call.k, call.v, out, chosen.name, chosen.fused)
    return AttentionOutput(out, weights)


@dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found: the backend chosen and each backend's verdict.

    ``verdicts`` maps each registered backend to ``None`` (it can serve the call) or the reason
    it cannot. ``rules`` maps each backend with an auto rule to ``(fires, why)``; ``rule`` is
    the line that decided auto's choice; ``notes`` holds what backends add (a plan, a compile
    state). ``str()`` renders the report.
    """

    chosen: str
    requested: str
    dims: Dims
    summary: str
    verdicts: dict[str, str | None] = field(default_factory=dict)
    rules: dict[str, tuple[bool, str]] = field(default_factory=dict)
    rule: str = ""
    notes: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"attnkit.explain: {self.summary}"]
        if self.requested == "auto":
            lines.append(f"  auto takes: {self.chosen} ({get_backend(self.chosen).description})")
            lines.append(f"  auto's rule: {self.rule}")
            if self.chosen in self.notes:
                lines.append(f"  {self.chosen}: {self.notes[self.chosen]}")
            lines.append("  passed over:")
            rank = {n: i for i, n in enumerate(AUTO_ORDER)}
            for name, reason in self.verdicts.items():
                if name == self.chosen:
                    continue
                fires, why = self.rules.get(name, (True, ""))
                if reason is not None:
                    lines.append(f"    {name}: cannot serve: {reason}")
                elif name not in rank:
                    lines.append(f"    {name}: can serve, but auto uses it only when named")
                elif not fires:
                    lines.append(f"    {name}: can serve, but its auto rule does not fire: {why}")
                else:
                    lines.append(
                        f"    {name}: can serve, but auto prefers {self.chosen} "
                        f"(order: {' > '.join(AUTO_ORDER)})"
                    )
                if name in self.notes and reason is None:
                    lines.append(f"      {self.notes[name]}")
        else:
            lines.append(f"  backend={self.requested!r} named; it can serve the call")
            if self.chosen in self.notes:
                lines.append(f"  {self.chosen}: {self.notes[self.chosen]}")
            for name, reason in self.verdicts.items():
                verdict = "can serve" if reason is None else f"cannot serve: {reason}"
                if name != self.chosen:
                    lines.append(f"    {name}: {verdict}")
        return "\n".join(lines)


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | MaskSpec | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
) -> Explanation:
    """Which backend :func:`attention` takes for these arguments, and why not the others.

    Same arguments as :func:`attention`; validates them the same way and runs nothing.

    >>> q = torch.randn(1, 8, 128, 64)
    >>> print(explain(q, q, q, return_weights=True))  # doctest: +ELLIPSIS
    attnkit.explain: q (B=1, H=8, L=128, Dk=64) ...
      auto takes: math (...)
      auto's rule: the first in auto's order (...) that can serve
      passed over:
        sdpa: cannot serve: fused kernels do not return the attention weights ...
    ...
    """
    where = "attnkit.explain"
    call = _prepare(q, k, v, mask, causal, scale, dropout_p, return_weights, where)
    call = replace(call, stand_in=True)  # explain runs nothing: never build an L x S mask
    chosen = _choose(call, backend, where)
    verdicts = {name: call.check(get_backend(name)) for name in available_backends()}
    rules = {
        name: call.rule(get_backend(name))
        for name in available_backends()
        if get_backend(name).rule is not None
    }
    notes = {
        name: note
        for name in available_backends()
        if verdicts[name] is None and (note := call.note(get_backend(name))) is not None
    }
    d = call.dims
    if mask is None:
        mask_str = "none"
    elif isinstance(mask, MaskSpec):
        mask_str = f"spec {mask!r}"
    else:
        mask_str = f"{'bool' if mask.dtype == torch.bool else 'float'} {tuple(mask.shape)}"
    summary = (
        f"q (B={d.B}, H={d.H}, L={d.L}, Dk={d.Dk})  k (Hkv={d.Hkv}, S={d.S})  v (Dv={d.Dv})\n"
        f"  {q.dtype} on {q.device}; mask: {mask_str}; causal: {causal}; "
        f"scale: {call.scale:.4g}; dropout_p: {call.dropout_p}; "
        f"return_weights: {call.return_weights}"
    )
    rule = call.rule(chosen)[1]
    return Explanation(chosen.name, backend, d, summary, verdicts, rules, rule, notes)
