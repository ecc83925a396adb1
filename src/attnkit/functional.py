"""``attention()``, the one entry point; the path of a call is described in
:mod:`attnkit.backends`.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, overload

import torch

from attnkit.backends import Choice, choose, memo
from attnkit.call import AttentionCall
from attnkit.inspect.tracing import record_attention, recording
from attnkit.mask_checks import check_mask
from attnkit.masks import MaskSpec
from attnkit.validate import check_qkv, check_scalars, check_sinks, warn_if_inverted_causal

__all__ = ["AttentionOutput", "attention", "run_call"]

WHERE = "attnkit.attention"


class AttentionOutput(NamedTuple):
    """Output and weights together; unpacks as ``out, weights = ...``.

    ``output`` is ``(B, H, L, Dv)`` from :func:`attention` and ``(B, L, E)`` from the modules;
    ``weights`` is ``(B, H, L, S)`` when asked for, else ``None``.
    """

    output: torch.Tensor
    weights: torch.Tensor | None


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
    softcap: float | None = ...,
    sinks: torch.Tensor | None = ...,
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
    softcap: float | None = ...,
    sinks: torch.Tensor | None = ...,
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
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
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
        softcap: logit soft-capping (Gemma 2): the scaled scores become
            ``softcap * tanh(scores / softcap)`` before the mask is applied.
        sinks: attention sinks, logits that join a row's softmax denominator and contribute
            no value (their gradient is computed): ``(H,)`` (gpt-oss ``s_aux``), one per query
            head for every row, or ``(B, H, L)`` (Inkling 2), one per query row and head
            (``(1, H, L)`` serves every sequence of the batch). A row that sees no key then
            gives 0.

    Returns:
        ``(B, H, L, Dv)``; with ``return_weights=True`` an :class:`AttentionOutput`
        ``(output, weights)``. A query row with nothing to attend to gives output 0 and
        gradient 0, never NaN. NaN or inf in q, k or v reaches exactly the rows that can see
        it (eager calls on the CPU, :mod:`attnkit.backends.nonfinite`): a query row holding
        one, or allowed to see a key holding one, gives NaN output and weights; a row allowed
        to see a value holding one gives NaN output (its weights stay finite); other rows are
        as if it were absent.

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

    Long because this docstring is the function's reference; the body is the checks, one
    call built, one run.
    """
    # a call like an earlier one runs its kernel directly (backends.memo)
    no_dropout = type(dropout_p) is float and dropout_p == 0.0  # (else checked first)
    key = None
    if sinks is None and softcap is None and return_weights is False and no_dropout:
        out, key = memo.run_direct(q, k, v, mask, causal, scale, backend)
        if out is not None:
            return out
    dims = check_qkv(q, k, v, where=WHERE)
    check_mask(mask, q, dims, where=WHERE)
    warn_if_inverted_causal(mask)
    check_scalars(
        dims, where=WHERE, causal=causal, scale=scale, dropout_p=dropout_p,
        return_weights=return_weights, softcap=softcap,
    )  # fmt: skip
    check_sinks(sinks, q, dims, where=WHERE)
    call = AttentionCall.build(
        q=q, k=k, v=v, dims=dims, where=WHERE, mask=mask, causal=causal, scale=scale,
        dropout_p=dropout_p, return_weights=return_weights, softcap=softcap, sinks=sinks,
    )  # fmt: skip
    choice = choose(call, backend, WHERE)
    result = _run(choice)
    if key is not None:
        memo.keep_direct(key, choice, mask if isinstance(mask, MaskSpec) else None)
    return result if return_weights else result.output


def run_call(call: AttentionCall, backend: str = "auto", where: str = WHERE) -> AttentionOutput:
    """Run a call built by :meth:`AttentionCall.build` on ``backend`` ("auto" or a name):
    always ``(output, weights or None)``. The modules build their calls and run them here."""
    return _run(choose(call, backend, where))


def _run(choice: Choice) -> AttentionOutput:
    out, weights = choice.run()
    if recording():  # attnkit.trace() is open: record shapes into this thread's traces
        call = choice.call
        record_attention(call.q, call.k, call.v, out, choice.name, choice.backend.fused)
    return AttentionOutput(out, weights)
