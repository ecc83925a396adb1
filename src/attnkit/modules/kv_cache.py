"""The KV cache: preallocated key/value buffers that incremental decoding appends to.

Dimension legend: B batch, Hkv key/value heads, T new tokens, N ``max_len`` (the buffers'
length), S cached length after the update, Dk key head dim, Dv value head dim.

A :class:`KVCache` holds ``k (B, Hkv, N, Dk)`` and ``v (B, Hkv, N, Dv)`` and each sequence's
length. ``update(pos, k, v)`` writes ``T`` new keys/values at ``pos`` and returns everything
cached so far. Attention of the ``T`` new queries against the cache is then the end-aligned
causal rule of :func:`attnkit.attention` (query ``i`` of ``T`` sees keys ``j <= i + S - T``),
per sequence when the sequences have different lengths (:meth:`KVCache.rule`).

**Static shapes** (``KVCache(..., static=True)``, for ``torch.compile``): ``update`` returns the
whole buffers ``(B, Hkv, N, D)`` and :meth:`KVCache.rule` is always a mask spec built from the
``lengths`` tensor (:func:`~attnkit.masks.sequence_causal`, or
:func:`~attnkit.masks.padding` without ``causal``): the keys past a sequence's length are
masked out instead of sliced off. Nothing the cache returns changes shape between decode
steps and no Python number changes either (:meth:`KVCache.next_pos` is the ``(B,)`` lengths
tensor), so ``torch.compile(step, fullgraph=True)`` of a decode step compiles once and runs
every later step without recompiling. The price: each step attends over all ``N`` keys
(a backend that plans the spec skips the masked blocks; a dense mask reads them), so build it
with ``max_len`` no larger than the prompt plus the new tokens need. Errors from a compiled
graph (writing past ``max_len``) are a ``RuntimeError`` with the same words; eager calls raise
:class:`~attnkit.AttentionInputError` as the dynamic cache does. The modules refuse a user's
``mask`` with a static cache (:meth:`KVCache.mask_error`): over the whole buffer, an end-aligned
rule would place the new queries at the buffer's end.

**Memory pages.** A CPU buffer of 4 MiB or more asks Linux for transparent huge pages (2 MiB;
``madvise(MADV_HUGEPAGE)`` on its 2 MiB-aligned part, before the zeros touch it): a decode step
that reads a long cache from memory crosses a 4 KiB page every few keys, and each new page
costs the TLB and the hardware prefetchers (docs/benchmarks.md, "Decoding"). It is advice:
where the kernel's THP setting is ``never``, or off Linux, the buffer is an ordinary one.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from functools import cache

import torch
from torch import nn

from attnkit.errors import AttentionInputError, check_bool, check_dtype_arg, check_int, shape_str
from attnkit.masks import MaskSpec, padding, sequence_causal
from attnkit.validate import can_read_values

__all__ = ["KVCache"]

WHERE = "attnkit.KVCache"
#: a transparent huge page on x86-64 and arm64 (4 KiB granules), and Linux's MADV_HUGEPAGE
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` (Linux), else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _buffer(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None
) -> torch.Tensor:
    """Zeros of ``shape``: on a CPU, from 4 MiB on, huge pages asked for before the zeros are
    written (the module docstring says why); a refusal leaves an ordinary buffer."""
    t = torch.empty(shape, dtype=dtype, device=device)
    madvise = _madvise()
    if t.device.type == "cpu" and t.nbytes >= 2 * HUGE_PAGE and madvise is not None:
        start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the 2 MiB-aligned part
        end = (t.data_ptr() + t.nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            madvise(start, end - start, _MADV_HUGEPAGE)  # advice: a refusal changes nothing
    return t.zero_()


class KVCache(nn.Module):
    """Preallocated key/value buffers for incremental decoding, one per attention layer.

    Args:
        batch_size: ``B``, the sequences decoded together.
        num_kv_heads: ``Hkv``.
        max_len: ``N``, the most tokens a sequence can hold; writing past it raises.
        head_dim: ``Dk``.
        v_head_dim: ``Dv`` (default ``Dk``).
        dtype, device: of the buffers (and of the keys/values written to them).
        static: ``True`` for static shapes (``torch.compile``): ``update`` returns the whole
            buffers and :meth:`rule` masks each sequence's keys past its length (the module
            docstring says more).

    Buffers (not saved in a ``state_dict``): ``k (B, Hkv, N, Dk)``, ``v (B, Hkv, N, Dv)`` and
    ``lengths (B,)``, the number of tokens each sequence holds.

    ``update(pos, k, v)`` writes ``k (B, Hkv, T, Dk)`` and ``v (B, Hkv, T, Dv)`` at positions
    ``pos .. pos + T - 1`` and returns ``(k_all, v_all)``, ``(B, Hkv, S, D)`` views of the
    buffers with ``S = max(lengths)``. ``pos`` is an int (every sequence at the same place) or
    a ``(B,)`` tensor (sequences of different lengths, a ragged batch); it may not leave a gap
    after a sequence's cached tokens, and may be smaller (to overwrite, rewinding). Afterwards
    ``lengths = pos + T``. :meth:`next_pos` is where the next update goes; :meth:`rule` is the
    mask for the new queries; :meth:`truncate` shortens sequences (for a right-padded batch);
    :meth:`reset` empties the cache.

    >>> cache = KVCache(2, 4, max_len=16, head_dim=8)
    >>> k_all, v_all = cache.update(0, torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8))
    >>> k_all.shape, cache.next_pos()
    (torch.Size([2, 4, 5, 8]), 5)
    >>> import attnkit
    >>> q = torch.randn(2, 4, 1, 8)
    >>> k_all, v_all = cache.update(5, torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8))
    >>> attnkit.attention(q, k_all, v_all, causal=True).shape   # 1 query, 6 keys
    torch.Size([2, 4, 1, 8])

    With ``static=True``, ``update`` returns the buffers ``(B, Hkv, N, D)`` themselves,
    :meth:`next_pos` is always the ``(B,)`` lengths tensor and :meth:`rule` always a spec, so
    that a compiled decode step sees the same shapes at every step:

    >>> static = KVCache(2, 4, max_len=16, head_dim=8, static=True)
    >>> k_all, v_all = static.update(0, torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8))
    >>> k_all.shape, static.next_pos()
    (torch.Size([2, 4, 16, 8]), tensor([5, 5]))
    >>> pos = static.next_pos()
    >>> k_all, v_all = static.update(pos, torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8))
    >>> attnkit.attention(q, k_all, v_all, mask=static.rule(1)).shape   # 1 query, 16 keys
    torch.Size([2, 4, 1, 8])
    """

    k: torch.Tensor
    v: torch.Tensor
    lengths: torch.Tensor

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        v_head_dim: int | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        static: bool = False,
    ) -> None:
        super().__init__()
        check_dtype_arg(WHERE, dtype)
        check_bool(WHERE, "static", static, "False (a growing view) or True (static shapes)")
        self.static = static
        Dv = head_dim if v_head_dim is None else v_head_dim
        for name, value in (
            ("batch_size", batch_size),
            ("num_kv_heads", num_kv_heads),
            ("max_len", max_len),
            ("head_dim", head_dim),
            ("v_head_dim", Dv),
        ):
            check_int(WHERE, name, value)
        B, Hkv, N = batch_size, num_kv_heads, max_len
        self.max_len = N
        self.register_buffer("k", _buffer((B, Hkv, N, head_dim), dtype, device), persistent=False)
        self.register_buffer("v", _buffer((B, Hkv, N, Dv), dtype, device), persistent=False)
        self.register_buffer(
            "lengths", torch.zeros(B, dtype=torch.long, device=device), persistent=False
        )
        # the common length while every sequence has one; a static cache keeps no Python
        # number that changes between steps (a compiled graph would be guarded on it)
        self._uniform: int | None = None if static else 0

    def extra_repr(self) -> str:
        B, Hkv, N, Dk = self.k.shape
        return (
            f"batch={B}, kv_heads={Hkv}, max_len={N}, head_dim={Dk}, v_head_dim={self.v.shape[-1]}"
            + (", static=True" if self.static else "")
        )

    @property
    def ragged(self) -> bool:
        """The dynamic cache's sequences have different lengths (:meth:`rule` is a spec)."""
        return not self.static and self._uniform is None

    def next_pos(self) -> int | torch.Tensor:
        """Where the next :meth:`update` goes: an int while every sequence has the same length,
        else each sequence's length ``(B,)`` (always, in a static cache)."""
        if self.static:
            return self.lengths.clone()
        return self._uniform if self._uniform is not None else self.lengths.clone()

    def update(
        self, pos: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``T`` new keys/values at ``pos``; return all cached ``(B, Hkv, S, D)`` (the
        whole buffers ``(B, Hkv, N, D)`` in a static cache)."""
        self._check_kv(k, v)
        if self.static:
            return self._update_static(pos, k, v)
        T = k.shape[2]
        if isinstance(pos, torch.Tensor):
            pos = self._check_pos_tensor(pos)
            if bool((pos == pos[0]).all()):
                pos = int(pos[0])
        if isinstance(pos, int):
            self._check_range(pos, pos, T)
            self.k[:, :, pos : pos + T] = k
            self.v[:, :, pos : pos + T] = v
            self.lengths.fill_(pos + T)
            self._uniform = pos + T
            S = pos + T
        else:
            lo, hi = int(pos.min()), int(pos.max())
            self._check_range(lo, hi, T, pos)
            idx = pos[:, None] + torch.arange(T, device=pos.device)  # (B, T)
            B, Hkv, _, _ = k.shape
            self.k.scatter_(2, idx[:, None, :, None].expand(B, Hkv, T, k.shape[3]), k)
            self.v.scatter_(2, idx[:, None, :, None].expand(B, Hkv, T, v.shape[3]), v)
            self.lengths.copy_(pos + T)
            self._uniform = None
            S = hi + T
        return self.k[:, :, :S], self.v[:, :, :S]

    def _update_static(
        self, pos: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``update`` of a static cache: a scatter at each sequence's ``pos``, checked eagerly
        (an :class:`AttentionInputError`) or, in a compiled graph, by an assert in the graph."""
        B, Hkv, T, Dk = k.shape
        lengths = self.lengths
        if isinstance(pos, torch.Tensor):
            pos = self._check_pos_tensor(pos)
        else:
            pos = torch.full((B,), pos, dtype=torch.long, device=lengths.device)
        if can_read_values(pos):
            self._check_range(int(pos.min()), int(pos.max()), T, pos)
        elif torch.compiler.is_compiling():  # no sizes in the words: they may be symbolic
            ok = (pos >= 0) & (pos + T <= self.k.shape[2]) & (pos <= lengths)
            torch._assert_async(
                ok.all(),
                f"{WHERE}.update: `pos` out of range: writing T new tokens needs 0 <= pos <= "
                "each sequence's cached length and pos + T <= max_len (build the cache with a "
                "larger max_len: prompt + new tokens, or reset() it)",
            )
        idx = pos[:, None] + torch.arange(T, device=pos.device)  # (B, T)
        self.k.scatter_(2, idx[:, None, :, None].expand(B, Hkv, T, Dk), k)
        self.v.scatter_(2, idx[:, None, :, None].expand(B, Hkv, T, v.shape[3]), v)
        lengths.copy_(pos + T)
        return self.k, self.v

    def rule(self, new: int, *, causal: bool = True) -> MaskSpec | None:
        """The mask for the ``new`` queries just written, against the keys of :meth:`update`.

        ``None`` while every sequence has the same length: ``attention(q, k_all, v_all,
        causal=causal)`` is then exact (the end-aligned rule). In a ragged batch, a spec:
        the end-aligned causal rule per sequence (``causal``), or each sequence's keys only.
        A static cache always returns the spec (its keys include the empty rest of the buffer).
        """
        if self._uniform is not None:
            return None
        lengths = self.lengths.clone()
        return sequence_causal(lengths, new) if causal else padding(lengths)

    def mask_error(self, where: str, mask: object) -> AttentionInputError:
        """The error for a module's ``mask`` given with a static cache, which refuses one: its
        keys are the whole buffer, so a rule placed from the end of the keys (``causal``,
        ``sliding_window``, ``alibi``: query ``i`` at key ``i + S - L``) would place the new
        queries at the buffer's end instead of after each sequence's last token."""
        kind = type(mask).__name__
        return AttentionInputError(
            where,
            "mask",
            "a static KV cache attends over its whole buffer, where a mask's end-aligned "
            "positions (causal, sliding_window, alibi) would stand at the buffer's end, not "
            "after each sequence's last token; it takes no mask.",
            got=f"mask ({kind}) with {WHERE}(static=True, max_len={self.max_len})",
            expected="mask=None with a static cache (its own rule is the causal one)",
            fix="decode a masked or ALiBi model with the dynamic cache (static=False)",
        )

    def ragged_mask_error(self, where: str, mask: MaskSpec) -> AttentionInputError:
        """The error for a module's mask spec that places the queries from the end of the keys
        (:attr:`~attnkit.masks.MaskSpec.reads_query_position`: causal, sliding_window, alibi,
        document) while the sequences of the batch have different lengths: the rule would put
        every sequence's new tokens after the longest one's last token."""
        return AttentionInputError(
            where,
            "mask",
            f"the mask {mask!r} counts query positions from the end of the keys, one place for "
            "the whole batch, but the cached sequences have different lengths "
            f"({self.lengths.tolist()}): a shorter sequence's new tokens would be placed after "
            "the longest one's.",
            got=f"mask={mask!r} with cached lengths {self.lengths.tolist()}",
            expected="a mask of keys alone (padding, key_mask, prefix_keys) with a ragged "
            "cache, or sequences of one length",
            fix="decode the sequences of different lengths in separate batches (or left-pad "
            "them to one length and mask the padding with key_mask), or drop the mask",
        )

    def truncate(self, lengths: int | torch.Tensor) -> None:
        """Shorten sequences to ``lengths`` (int or ``(B,)``, at most the current lengths).

        After a right-padded batch was written whole, this drops each sequence's padding, so
        that the next token of sequence ``b`` goes right after its last real one.
        """
        new = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device)
        new = new.expand_as(self.lengths)
        if can_read_values(new) and bool(((new < 0) | (new > self.lengths)).any()):
            raise AttentionInputError(
                f"{WHERE}.truncate",
                "lengths",
                "a cache can only be shortened.",
                got=f"lengths={new.tolist()}  cached={self.lengths.tolist()}",
                expected="0 <= lengths <= the cached lengths",
            )
        self.lengths.copy_(new)
        if not self.static:
            self._uniform = int(new[0]) if bool((new == new[0]).all()) else None

    def reset(self) -> None:
        """Empty the cache (the buffers stay allocated)."""
        self.lengths.zero_()
        if not self.static:
            self._uniform = 0

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        B, Hkv, _, Dk = self.k.shape
        Dv = self.v.shape[-1]
        dims = ("B", "Hkv", "T", "D")
        ok = (
            isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor)
            and k.dim() == v.dim() == 4
            and tuple(k.shape[:2]) == tuple(v.shape[:2]) == (B, Hkv)
            and k.shape[2] == v.shape[2]
            and k.shape[3] == Dk
            and v.shape[3] == Dv
        )
        if not ok:
            got = "  ".join(
                shape_str(n, t, dims) if isinstance(t, torch.Tensor) else f"{n}: {type(t).__name__}"
                for n, t in (("k", k), ("v", v))
            )
            raise AttentionInputError(
                f"{WHERE}.update",
                "k",
                "the new keys/values do not fit the cache.",
                got=got,
                expected=f"k (B={B}, Hkv={Hkv}, T, Dk={Dk})  v (B={B}, Hkv={Hkv}, T, Dv={Dv})",
                fix="build the cache with the model's batch size, key/value heads and head dims",
            )
        if k.dtype != self.k.dtype or v.dtype != self.v.dtype or k.device != self.k.device:
            raise AttentionInputError(
                f"{WHERE}.update",
                "k",
                "the new keys/values have another dtype or device than the cache.",
                got=f"k {k.dtype} on {k.device}, v {v.dtype}; cache {self.k.dtype} on "
                f"{self.k.device}",
                expected=f"{self.k.dtype} on {self.k.device}",
                fix="build the cache with the model's dtype and device "
                "(KVCache(..., dtype=..., device=...))",
            )

    def _check_pos_tensor(self, pos: torch.Tensor) -> torch.Tensor:
        B = self.k.shape[0]
        if (
            pos.is_floating_point()
            or pos.dtype == torch.bool
            or tuple(pos.shape) != (B,)
            or pos.device != self.lengths.device
        ):
            raise AttentionInputError(
                f"{WHERE}.update",
                "pos",
                "`pos` must be an int or one integer start position per sequence.",
                got=f"{shape_str('pos', pos, ('B',))} dtype={pos.dtype} on {pos.device}",
                expected=f"an int, or an integer tensor (B={B},) on {self.lengths.device}",
            )
        return pos.long()

    def _check_range(self, lo: int, hi: int, T: int, pos: torch.Tensor | None = None) -> None:
        where = f"{WHERE}.update"
        shown = f"pos={pos.tolist() if pos is not None else lo}"
        if lo < 0:
            raise AttentionInputError(
                where, "pos", "`pos` must be >= 0.", got=shown, expected="pos >= 0"
            )
        if hi + T > self.max_len:
            raise AttentionInputError(
                where,
                "pos",
                f"writing {T} token(s) at position {hi} would overflow the cache: "
                f"{hi + T} > max_len={self.max_len}.",
                got=f"{shown}  new tokens T={T}  max_len={self.max_len}",
                expected=f"pos + T <= max_len = {self.max_len}",
                fix=f"build the cache with max_len >= {hi + T} (prompt + new tokens), "
                "or reset() it to start over",
            )
        if pos is None and self._uniform is not None:
            gap = lo > self._uniform
        else:
            gap = bool(((pos if pos is not None else lo) > self.lengths).any())
        if gap:
            raise AttentionInputError(
                where,
                "pos",
                "`pos` would leave a gap after a sequence's cached tokens.",
                got=f"{shown}  cached lengths={self.lengths.tolist()}",
                expected="pos <= each sequence's cached length (next_pos())",
                fix="pass cache.next_pos()",
            )
