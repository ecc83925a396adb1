"""The built-in mask rules: causal, sliding windows, padding, key masks, documents, prefix-LM.

Dimension legend: B batch, L query length, S key length; ``b, h, q, kv`` are indices and
``off = S - L`` end-aligns the queries (query ``q`` stands at key position ``q + off``).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from attnkit.errors import is_int_tensor, tensor_got
from attnkit.masks.base import spec_error
from attnkit.masks.keys import tensor_key
from attnkit.masks.runs import HIGH, LOW, Spans, cpu, document_runs, full, key_run
from attnkit.masks.spec import MaskSpec, _Or

__all__ = [
    "causal",
    "causal_mask",
    "causal_window",
    "document",
    "key_mask",
    "padding",
    "prefix_lm",
    "sliding_window",
    "unmasked",
]


def causal_mask(L: int, S: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The end-aligned causal mask, ``(L, S)`` bool, True = may attend.

    Query ``i`` sees keys ``j <= i + S - L``: the last query sees every key, as a new token does
    when it is decoded against a KV cache of ``S - L`` earlier tokens. For ``L == S`` this is the
    usual lower triangle. For ``L = 2, S = 4``::

        1 1 1 0
        1 1 1 1

    and for ``L = 4, S = 2`` the first two queries see nothing (their output is 0)::

        0 0
        0 0
        1 0
        1 1

    >>> causal_mask(2, 4).int()
    tensor([[1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    """
    return torch.ones(L, S, dtype=torch.bool, device=device).tril(S - L)


def values_str(t: torch.Tensor) -> str:
    """A spec tensor's values for its repr: the list, or its shape where it holds no values
    (``meta``) or too many to read."""
    if t.device.type == "meta" or t.numel() > 64:
        return f"<{tuple(t.shape)} on {t.device.type}>"
    return str(t.tolist())


def _int_tensor(call: str, argument: str, t: object, shapes: str) -> torch.Tensor:
    if not is_int_tensor(t):
        spec_error(
            call,
            argument,
            f"`{argument}` must be an integer tensor.",
            got=tensor_got(argument, t, None),
            expected=f"an integer tensor of shape {shapes}",
            fix=f"torch.as_tensor({argument}, dtype=torch.long)",
        )
    return t


def _check_shape(
    call: str, argument: str, t: torch.Tensor, dims: tuple[int, ...], shapes: str
) -> None:
    if t.dim() not in dims:
        spec_error(
            call,
            argument,
            f"`{argument}` is {t.dim()}-D.",
            got=f"{argument} {tuple(t.shape)}",
            expected=f"{argument} of shape {shapes}",
            fix="one entry per sequence of the batch" if dims == (1,) else "reshape it",
        )


def _int_at_least(call: str, argument: str, n: object, low: int, meaning: str, fix: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < low:
        spec_error(
            call,
            argument,
            f"{call}({argument}) needs an int >= {low}, got {n!r}.",
            got=f"{argument}={n!r}",
            expected=f"{argument} >= {low} ({meaning})",
            fix=fix,
        )
    return n


def _check_not_negative(call: str, argument: str, t: torch.Tensor, meaning: str) -> None:
    """Refuse negative entries (a value check: skipped while torch.compile traces)."""
    if torch.compiler.is_compiling() or t.device.type == "meta" or not bool((t < 0).any()):
        return
    bad = t[t < 0].tolist()[:5]
    spec_error(
        call,
        argument,
        f"`{argument}` holds negative values {bad}; {meaning}.",
        got=f"{argument}={values_str(t)}",
        expected=f"{argument} >= 0 (0: {'none' if argument != 'prefix_len' else 'plain causal'})",
        fix=f"{argument}.clamp(min=0) if negative meant empty",
    )


def _bool_at(table: torch.Tensor, b: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    if table.shape[-1] == 0:  # no keys (S = 0): nothing to look up, and nothing allowed
        return (b + idx).new_zeros((), dtype=torch.bool).expand((b + idx).shape)
    return table[b, idx.clamp(0, table.shape[-1] - 1)]


class _Causal(MaskSpec):
    scratch_bytes = 0

    def key(self) -> Hashable:
        return ("causal",)

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return kv <= q + off

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        return (k_lo <= q_hi + off)[None, None], (k_hi <= q_lo + off)[None, None]

    def key_runs(self, pos: torch.Tensor, off: int) -> Spans:
        return full(pos, LOW), pos + off

    def __repr__(self) -> str:
        return "causal()"


class _Window(MaskSpec):
    def __init__(self, size: int) -> None:
        self.size = _int_at_least(
            "sliding_window",
            "size",
            size,
            1,
            "each query sees keys within size - 1 positions",
            "sliding_window(1) sees only the query's own position; use an int",
        )

    def key(self) -> Hashable:
        return ("window", self.size)

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return (q + off - kv).abs() < self.size

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        gap = torch.clamp(torch.maximum(k_lo - (q_hi + off), (q_lo + off) - k_hi), min=0)
        far = torch.maximum((q_hi + off - k_lo).abs(), (k_hi - (q_lo + off)).abs())
        return (gap < self.size)[None, None], (far < self.size)[None, None]

    def key_runs(self, pos: torch.Tensor, off: int) -> Spans:
        return pos + off - self.size + 1, pos + off + self.size - 1

    def __repr__(self) -> str:
        return f"sliding_window({self.size})"


class _Padding(MaskSpec):
    """Keys at or beyond each sequence's length are padding; optionally query rows too."""

    reads_query_position = False
    scratch_bytes = 0

    def __init__(self, lengths: torch.Tensor, q_lengths: torch.Tensor | None) -> None:
        self.lengths = _int_tensor("padding", "lengths", lengths, "(B,)")
        _check_shape("padding", "lengths", lengths, (1,), "(B,)")
        _check_not_negative("padding", "lengths", lengths, "a length counts real keys")
        self.q_lengths = None
        if q_lengths is not None:
            self.q_lengths = _int_tensor("padding", "q_lengths", q_lengths, "(B,)")
            if q_lengths.shape != lengths.shape:
                spec_error(
                    "padding",
                    "q_lengths",
                    "`lengths` and `q_lengths` have different shapes.",
                    got=f"lengths {tuple(lengths.shape)}  q_lengths {tuple(q_lengths.shape)}",
                    expected="both (B,)",
                    fix="one key length and one query length per sequence",
                )
            _check_not_negative("padding", "q_lengths", q_lengths, "a length counts real queries")
        self.batch = lengths.shape[0]

    def key(self) -> Hashable:
        q = None if self.q_lengths is None else tensor_key(self.q_lengths)
        return ("padding", tensor_key(self.lengths), q)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.lengths, self.q_lengths) if t is not None]

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        ok = kv < self.lengths[b]
        if self.q_lengths is not None:
            ok = ok & (q < self.q_lengths[b])
        return ok

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        n = self.lengths.view(-1, 1, 1, 1)
        any_, all_ = k_lo < n, k_hi < n
        if self.q_lengths is not None:
            m = self.q_lengths.view(-1, 1, 1, 1)
            any_, all_ = any_ & (q_lo < m), all_ & (q_hi < m)
        return any_, all_

    def key_runs(self, pos: torch.Tensor, off: int) -> Spans:
        lengths = cpu(self.lengths)[:, None]
        lo = full(pos, LOW).expand(lengths.shape[0], -1)
        if self.q_lengths is not None:  # padded query rows see nothing
            lo = torch.where(pos < cpu(self.q_lengths)[:, None], LOW, HIGH)
        return lo, (lengths - 1).expand(-1, pos.shape[1])

    def __repr__(self) -> str:
        extra = "" if self.q_lengths is None else f", q_lengths={values_str(self.q_lengths)}"
        return f"padding({values_str(self.lengths)}{extra})"


class _KeyMask(MaskSpec):
    """Keys allowed per sequence, from a bool ``(B, S)`` tensor (True = a real key)."""

    reads_query_position = False
    scratch_bytes = 0

    def __init__(self, keep: torch.Tensor) -> None:
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.dim() != 2:
            got = f"keep: {type(keep).__name__}"
            if isinstance(keep, torch.Tensor):
                got = f"keep {tuple(keep.shape)} dtype={keep.dtype}"
            spec_error(
                "key_mask",
                "keep",
                "key_mask(keep) needs a bool (B, S) tensor, True = a real key.",
                got=got,
                expected="keep: bool (B, S), True = a real key",
                fix="lengths -> torch.arange(S) < lengths[:, None]; a torch key_padding_mask "
                "(True = padding) -> ~key_padding_mask",
            )
        self.keep = keep
        self.batch = keep.shape[0]
        self.length = keep.shape[1]

    def key(self) -> Hashable:
        return ("key_mask", tensor_key(self.keep))

    def tensors(self) -> list[torch.Tensor]:
        return [self.keep]

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return _bool_at(self.keep, b, kv) & (kv < self.keep.shape[1])

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        S = self.keep.shape[1]
        counts = torch.nn.functional.pad(self.keep.long().cumsum(1), (1, 0))  # (B, S+1)
        B = self.keep.shape[0]
        lo = k_lo.clamp(max=S).expand(B, -1)
        hi = (k_hi + 1).clamp(max=S).expand(B, -1)
        kept = counts.gather(1, hi) - counts.gather(1, lo)  # (B, nk)
        kept = kept.view(B, 1, 1, -1)
        return kept > 0, kept == (k_hi - k_lo + 1).view(1, 1, 1, -1)

    def key_runs(self, pos: torch.Tensor, off: int) -> Spans | None:
        return key_run(self.keep, pos)

    def split_holes(self) -> tuple[MaskSpec, torch.Tensor | None]:
        if self.keep.shape[1] == 0:
            return self, None
        keep = self.keep.detach().to("cpu")
        idx = torch.arange(keep.shape[1])
        first = torch.where(keep, idx, keep.shape[1]).amin(dim=1, keepdim=True)
        last = torch.where(keep, idx, -1).amax(dim=1, keepdim=True)
        hull = (idx >= first) & (idx <= last)
        return (self, None) if torch.equal(hull, keep) else (_KeyMask(hull), keep)

    def __repr__(self) -> str:
        return f"key_mask(<bool {tuple(self.keep.shape)}>)"


class _Document(MaskSpec):
    """Packed sequences: a query sees only keys of its own document."""

    scratch_bytes = 1

    def __init__(self, ids: torch.Tensor) -> None:
        ids = _int_tensor("document", "ids", ids, "(S,) or (B, S)")
        _check_shape("document", "ids", ids, (1, 2), "(S,) or (B, S)")
        self.ids = ids if ids.dim() == 2 else ids[None]  # (B', S)
        self.batch = ids.shape[0] if ids.dim() == 2 else None
        self.length = ids.shape[-1]

    def key(self) -> Hashable:
        return ("document", tensor_key(self.ids))

    def tensors(self) -> list[torch.Tensor]:
        return [self.ids]

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        bb = b if self.batch is not None else torch.zeros_like(b)
        return _bool_at(self.ids, bb, q + off) == _bool_at(self.ids, bb, kv)

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        S = self.ids.shape[1]
        lo_q, hi_q = self._range(q_lo.view(-1) + off, q_hi.view(-1) + off, S)  # (B', nq)
        lo_k, hi_k = self._range(k_lo.view(-1), k_hi.view(-1), S)  # (B', nk)
        lo_q, hi_q = lo_q[:, None, :, None], hi_q[:, None, :, None]
        lo_k, hi_k = lo_k[:, None, None, :], hi_k[:, None, None, :]
        any_ = (lo_q <= hi_k) & (lo_k <= hi_q)
        all_ = (lo_q == hi_q) & (lo_k == hi_k) & (lo_q == lo_k)
        return any_, all_

    def key_runs(self, pos: torch.Tensor, off: int) -> Spans | None:
        return document_runs(self.ids, pos + off)

    def _range(
        self, lo: torch.Tensor, hi: torch.Tensor, S: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Min and max document id over each inclusive index range ``[lo, hi]``."""
        lo, hi = lo.clamp(0, S - 1), hi.clamp(0, S - 1)
        mins, maxs = [], []
        for a, z in zip(lo.tolist(), hi.tolist(), strict=True):
            seg = self.ids[:, a : z + 1]
            mins.append(seg.amin(dim=1))
            maxs.append(seg.amax(dim=1))
        return torch.stack(mins, dim=1), torch.stack(maxs, dim=1)

    def __repr__(self) -> str:
        return f"document(<ids {tuple(self.ids.shape)}>)"


class _PrefixKeys(MaskSpec):
    """Keys before ``prefix_len`` (per sequence when a tensor) are visible to every query."""

    reads_query_position = False
    scratch_bytes = 0

    def __init__(self, prefix_len: int | torch.Tensor) -> None:
        if isinstance(prefix_len, torch.Tensor):
            self.prefix: int | torch.Tensor = _int_tensor(
                "prefix_lm", "prefix_len", prefix_len, "(B,)"
            )
            _check_shape("prefix_lm", "prefix_len", prefix_len, (1,), "(B,)")
            _check_not_negative("prefix_lm", "prefix_len", prefix_len, "it counts prompt keys")
            self.batch = prefix_len.shape[0]
        else:
            self.prefix = _int_at_least(
                "prefix_lm",
                "prefix_len",
                prefix_len,
                0,
                "0 is plain causal; or a (B,) tensor, one prefix per sequence",
                "the number of prompt tokens every query may see",
            )

    def key(self) -> Hashable:
        n = self.prefix
        return ("prefix", tensor_key(n) if isinstance(n, torch.Tensor) else n)

    def tensors(self) -> list[torch.Tensor]:
        return [self.prefix] if isinstance(self.prefix, torch.Tensor) else []

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        n = self.prefix[b] if isinstance(self.prefix, torch.Tensor) else self.prefix
        return kv < n

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        n = self.prefix.view(-1, 1, 1, 1) if isinstance(self.prefix, torch.Tensor) else self.prefix
        return k_lo < n, k_hi < n

    def key_runs(self, pos: torch.Tensor, off: int) -> Spans:
        n = self.prefix
        hi = cpu(n)[:, None] - 1 if isinstance(n, torch.Tensor) else full(pos, n - 1)
        return full(pos, LOW), hi.expand(-1, pos.shape[1])

    def __repr__(self) -> str:
        n = values_str(self.prefix) if isinstance(self.prefix, torch.Tensor) else self.prefix
        return f"prefix_keys({n})"


class _Unmasked(MaskSpec):
    """Every pair allowed (transformers' bidirectional rule, no padding)."""

    reads_query_position = False

    def key(self) -> Hashable:
        return ("unmasked",)

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return (q >= 0) & (kv >= 0)

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        every = ((q_lo >= 0) & (k_lo >= 0))[None, None]
        return every, every

    def __repr__(self) -> str:
        return "unmasked()"


def is_causal(spec: MaskSpec | None) -> bool:
    """Whether ``spec`` is exactly the causal rule (what ``causal=True`` means)."""
    return type(spec) is _Causal


def causal_window(spec: MaskSpec | None) -> int | None:
    """The window ``w`` when ``spec`` is exactly ``causal() & sliding_window(w)`` (either
    order): each query sees itself and the ``w - 1`` keys before. Else ``None``.

    >>> causal_window(sliding_window(4) & causal()), causal_window(sliding_window(4))
    (4, None)
    """
    parts = (getattr(spec, "a", None), getattr(spec, "b", None))
    if getattr(spec, "op", None) != "&" or spec is None or spec.has_bias:
        return None
    windows = [p for p in parts if isinstance(p, _Window)]
    if len(windows) != 1 or not any(type(p) is _Causal for p in parts):
        return None
    return windows[0].size


def causal() -> MaskSpec:
    """Query ``i`` sees keys ``j <= i + S - L`` (end-aligned, as ``attention(causal=True)``)."""
    return _Causal()


def sliding_window(size: int) -> MaskSpec:
    """Keys within ``size - 1`` positions of the query, both sides: ``|i + S - L - j| < size``.

    With ``causal()`` it is one-sided: each query sees itself and the ``size - 1`` keys before.
    """
    return _Window(size)


def padding(lengths: torch.Tensor, q_lengths: torch.Tensor | None = None) -> MaskSpec:
    """Sequence ``b`` has ``lengths[b]`` real keys; the rest are padding.

    ``q_lengths`` also marks query rows at or beyond ``q_lengths[b]`` as padding: they see
    nothing, so their output is 0. Lengths beyond ``S`` (or ``L``) mean every key (query) is
    real; negative lengths are refused.
    """
    return _Padding(lengths, q_lengths)


def key_mask(keep: torch.Tensor) -> MaskSpec:
    """Keys allowed per sequence from a bool ``(B, S)`` tensor, True = a real key."""
    return _KeyMask(keep)


def document(ids: torch.Tensor) -> MaskSpec:
    """Packed sequences: ``ids`` ``(S,)`` or ``(B, S)`` gives each position's document; a query
    attends only to keys of its own document (combine with ``causal()`` for causal packing)."""
    return _Document(ids)


def unmasked() -> MaskSpec:
    """Every pair allowed: a spec that stands for "no mask" where ``None`` would mean
    "decide by ``is_causal``" (what :func:`attnkit.interop.hf_attention` passes for
    transformers' bidirectional rule without padding; it runs it as ``mask=None,
    causal=False``)."""
    return _Unmasked()


def prefix_lm(prefix_len: int | torch.Tensor) -> MaskSpec:
    """Prefix-LM: every query sees the first ``prefix_len`` keys, and the rest causally."""
    return _Or(_PrefixKeys(prefix_len), _Causal())
