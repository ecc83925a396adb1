"""Each query row's run of keys from a mask function's values: :func:`function_runs`.

Dimension legend: ``B'`` batch rows the function is evaluated for (1 unless it reads ``b``),
``n`` query rows of one group, S keys, ``W = ceil(S / 8)`` words of eight keys.

The function is evaluated on every ``(b, q, kv)`` pair, a group of query rows against all the
keys at a time (at most :data:`RUN_CHUNK_PAIRS` pairs per call), with broadcasting int32 index
tensors made once. Each group's bool values are reduced to each row's first key, last key and
whether the keys between them are all allowed, eight keys a step: the ``(B', n, S)`` bools are
read as ``(B', n, W)`` int64 words (a word is 0 where its eight keys are all masked and
``0x0101010101010101`` where all are allowed), the first and last nonzero word found and
their bytes read, and the row is one run when every word strictly between those two is
all-allowed. Nothing is inferred beyond the values: the result is what the ``L x S`` values
say, and a row with a hole makes the answer ``None``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnkit.masks.runs import Spans

__all__ = ["RUN_CHUNK_PAIRS", "function_runs"]

#: (b, q, kv) pairs one call of the function evaluates at most while runs are found
RUN_CHUNK_PAIRS = 1 << 22

#: a word of eight allowed keys (bool bytes of 1)
_ALL = 0x0101010101010101

Call = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def function_runs(
    call: Call, pos: torch.Tensor, keys: tuple[int, int], batch: int, dev: torch.device
) -> Spans | None:
    """``lo, hi`` ``(B', L)`` int64 CPU: the global first and last key of each row's allowed
    keys among ``keys = (k0, S)`` (keys ``k0 .. k0 + S - 1``), ``call(b, h, q, kv)`` evaluated
    at head 0 on the query positions ``pos[0]`` (``(1, L)``) for ``batch`` batch rows; rows
    that see nothing get ``lo = k0 + S > hi = k0 - 1``. ``None`` where a row's keys are not
    one run."""
    k0, S = keys
    L = pos.shape[1]
    i32 = torch.int32
    b = torch.arange(batch, dtype=i32, device=dev).view(batch, 1, 1, 1)
    zero = torch.zeros(1, 1, 1, 1, dtype=i32, device=dev)
    kv = torch.arange(k0, k0 + S, dtype=i32, device=dev).view(1, 1, 1, S)
    rows = pos[0].to(device=dev, dtype=i32)
    step = max(1, RUN_CHUNK_PAIRS // max(batch * S, 1))
    los, his = [], []
    for r in range(0, L, step):
        q = rows[r : r + step].view(1, 1, -1, 1)
        ok = call(b, zero, q, kv).expand(batch, 1, q.shape[2], S)[:, 0]
        runs = row_runs(ok)
        if runs is None:
            return None  # a row with a hole: not one run
        first, last = runs
        seen = first <= last
        los.append(torch.where(seen, first + k0, k0 + S).cpu())
        his.append(torch.where(seen, last + k0, k0 - 1).cpu())
    return torch.cat(los, dim=1), torch.cat(his, dim=1)


def row_runs(ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The first and last allowed key of each row of ``ok`` ``(B', n, S)`` bool, ``(B', n)``
    int64 local indices (``first = S``, ``last = -1`` where a row allows none), or ``None``
    where some row's allowed keys are not one run (see the module doc)."""
    S = ok.shape[-1]
    words = -(-S // 8)
    if S % 8 or not ok.is_contiguous() or ok.storage_offset() % 8:
        padded = ok.new_zeros(*ok.shape[:-1], words * 8)  # False past the last key
        padded[..., :S] = ok
        ok = padded
    w = ok.view(torch.int64)  # (B', n, W): eight keys a word, in memory order
    nonzero = (w != 0).view(torch.uint8)
    fw = nonzero.argmax(-1, keepdim=True)  # the first word with an allowed key (0 if none)
    lw = words - 1 - nonzero.flip(-1).argmax(-1, keepdim=True)
    seen = nonzero.gather(-1, fw)[..., 0].bool()
    whole = (w == _ALL).sum(-1)  # all-allowed words: only between fw and lw, both included
    head = w.gather(-1, fw).view(torch.uint8) != 0  # (B', n, 8): the bytes of the two ends
    tail = w.gather(-1, lw).view(torch.uint8) != 0
    fb = head.view(torch.uint8).argmax(-1)
    lb = 7 - tail.flip(-1).view(torch.uint8).argmax(-1)
    fw, lw = fw[..., 0], lw[..., 0]
    first, last = fw * 8 + fb, lw * 8 + lb
    byte = torch.arange(8, device=ok.device)
    one = fw == lw  # the run (if any) within one word: bytes fb ..= lb all allowed
    in_head = (byte >= fb[..., None]) & (torch.where(one, lb, 7)[..., None] >= byte)
    in_tail = byte <= lb[..., None]
    ends_ok = ((head | ~in_head).all(-1)) & (one | (tail | ~in_tail).all(-1))
    head_whole = head.all(-1)
    inner_whole = whole - head_whole.long() - ((~one) & tail.all(-1)).long()
    inner_ok = inner_whole == (lw - fw - 1).clamp(min=0)
    if not bool((~seen | (ends_ok & inner_ok)).all()):
        return None
    return torch.where(seen, first, S), torch.where(seen, last, -1)
