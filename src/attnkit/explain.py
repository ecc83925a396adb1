"""``explain()``: which backend :func:`attnkit.attention` takes for a call, and why not the others.

It prints the decisions the dispatcher makes for the call (see :mod:`attnkit.backends` for the
path of a call), every registered backend's, each asked once.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnkit import cpu
from attnkit.backends import auto_order, available_backends, choose, get_backend
from attnkit.call import AttentionCall, Dims
from attnkit.mask_checks import check_mask
from attnkit.masks import MaskSpec
from attnkit.validate import check_qkv, check_scalars, check_sinks, warn_if_inverted_causal

__all__ = ["Explanation", "explain"]


@dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found: the backend chosen and each backend's verdict.

    ``verdicts`` maps each registered backend to ``None`` (it can serve the call) or the reason
    it cannot. ``rules`` maps each backend that can serve the call and has an auto rule for it
    to ``(fires, why)``; ``rule`` is the line that decided auto's choice; ``notes`` holds what
    backends add (a plan, a compile state); ``device`` is the device type auto planned for (its
    order and the backends' descriptions depend on it). ``cpu_path`` is the path of a
    bfloat16/float16 CPU call (:mod:`attnkit.cpu`: ``native``, ``fp32-upcast``, ``torch``),
    else ``None``; ``described`` the chosen backend's description on that device. ``str()``
    renders the report.
    """

    chosen: str
    requested: str
    dims: Dims
    summary: str
    verdicts: dict[str, str | None] = field(default_factory=dict)
    rules: dict[str, tuple[bool, str]] = field(default_factory=dict)
    rule: str = ""
    notes: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"
    cpu_path: str | None = None
    described: str = ""

    def __str__(self) -> str:
        lines = [f"attnkit.explain: {self.summary}"]
        if self.requested == "auto":
            described = self.described or get_backend(self.chosen).description
            lines.append(f"  auto takes: {self.chosen} ({described})")
            lines.append(f"  auto's rule: {self.rule}")
            if self.chosen in self.notes:
                lines.append(f"  {self.chosen}: {self.notes[self.chosen]}")
            lines.append("  passed over:")
            order = auto_order(self.device)
            rank = {n: i for i, n in enumerate(order)}
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
                        f"(order: {' > '.join(order)})"
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


def _summary(call: AttentionCall, mask: torch.Tensor | MaskSpec | None, causal: bool) -> str:
    """The call in words: its sizes, dtype, mask (as given), numbers and CPU path."""
    d, q = call.dims, call.q
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
    if call.softcap is not None or call.sinks is not None:
        sinks_str = "none" if call.sinks is None else _sinks_str(call.sinks)
        summary += f"\n  softcap: {call.softcap}; sinks: {sinks_str}"
    if call.cpu_path is not None:
        summary += f"\n  CPU path: {cpu.describe(call.cpu_path, q.dtype)}"
        summary += f"\n  CPU: {cpu.features()}"
    return summary


def _sinks_str(sinks: torch.Tensor) -> str:
    """The sinks in the summary's words: ``(4,) per head``, ``(2, 4, 8) per query row``."""
    return f"{tuple(sinks.shape)} per {'head' if sinks.dim() == 1 else 'query row'}"


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
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
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
    dims = check_qkv(q, k, v, where=where)
    check_mask(mask, q, dims, where=where)
    warn_if_inverted_causal(mask)
    check_scalars(
        dims, where=where, causal=causal, scale=scale, dropout_p=dropout_p,
        return_weights=return_weights, softcap=softcap,
    )  # fmt: skip
    check_sinks(sinks, q, dims, where=where)
    # explaining=True: runs nothing, and never builds an L x S mask
    call = AttentionCall.build(
        q=q, k=k, v=v, dims=dims, where=where, mask=mask, causal=causal, scale=scale,
        dropout_p=dropout_p, return_weights=return_weights, softcap=softcap, sinks=sinks,
        explaining=True,
    )  # fmt: skip
    choice = choose(call, backend, where, every=True)  # every backend's decision, once each
    names = available_backends()
    verdicts = {name: choice.verdict(name) for name in names}
    decisions = [choice.decisions[name] for name in names]
    rules = {d.backend: d.rule for d in decisions if d.rule is not None}
    notes = {
        d.backend: d.note for d in decisions if verdicts[d.backend] is None and d.note is not None
    }
    d = call.dims
    summary = _summary(call, mask, causal)
    chosen = choice.decision
    return Explanation(
        chosen.backend,
        backend,
        d,
        summary,
        verdicts,
        rules,
        choice.why,
        notes,
        call.device_type,
        call.cpu_path,
        chosen.description or choice.backend.description,
    )
