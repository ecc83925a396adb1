"""The ``blocked`` backend's tile planner: which query rows meet which keys, in few kernel calls.

Dimension legend: B batch, H query heads, L query length, S key length, R query rows per tile,
W keys per call, n tiles per call; ``g`` is the grain of the block map (32 unless L x S is huge).

A mask spec's block map (``g x g`` blocks: empty, partial, full) is read row by row:

* the key blocks a block row needs are cut into **segments**: runs of non-empty blocks, split
  at runs of empty blocks, with long runs of full blocks split off so that they need no mask;
* block rows are grouped ``R / g`` at a time (R is chosen per plan by a small cost model: tall
  tiles run the fused kernel at its best, short tiles waste less of a narrow band), and
  consecutive row groups with identical segments merge into one taller **tile**;
* each (tile, segment) is an **item**. Items of the same shape whose query and key starts step
  evenly (a sliding window: every tile is the last one shifted by ``R``) are batched into one
  **call**: the kernel sees ``n`` tiles as ``n`` batch entries, through ``as_strided`` views of
  q, k and v (no copies), with one mask for all of them when the spec is shift-invariant.

A tile's first segment *writes* its rows; later segments *merge* into them with the log-sum-exp
rule, so every query row gets exactly the softmax over all of its keys. The masks a plan keeps
are bool ``(n or 1, 1, R, W)`` (True = may attend) for partial segments only, so a plan's memory
follows the partial blocks (about ``L x 2g`` for a band), never ``L x S``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from attnkit.backends.blocked.config import BlockedConfig
from attnkit.masks import EMPTY, FULL, PARTIAL, MaskSpec, block_states

__all__ = ["Call", "Plan", "allowed", "make_plan", "tile_index"]


@dataclass
class Call:
    """One kernel call: ``n`` tiles of ``R`` query rows, each against ``W`` consecutive keys.

    Tile ``t`` is query rows ``[q0 + t*q_step, +R)`` and keys ``[k0 + t*k_step, +W)`` (local
    indices). ``b``/``h``: the batch element / query head it serves (``None``: all of them).
    ``mask``: bool ``(n or 1, 1, R, W)``, True = may attend (``None``: every pair allowed, or
    built per call when ``lazy``). ``dead``: bool ``(n or 1, 1, R)``, rows that see no key in
    this call. ``first``: the call writes its rows; otherwise it merges into them.
    """

    b: int | None
    h: int | None
    n: int
    R: int
    W: int
    q0: int
    q_step: int
    k0: int
    k_step: int
    masked: bool
    first: bool
    mask: torch.Tensor | None = None
    dead: torch.Tensor | None = None
    lazy: bool = False
    _float: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def pairs(self) -> int:
        """(query, key) pairs the kernel computes for this call, per batch entry and head."""
        return self.n * self.R * self.W


@dataclass
class Plan:
    """The calls that cover one attention problem, and what they were planned for."""

    calls: list[Call]
    spec: MaskSpec | None
    L: int
    S: int
    q_start: int
    k_start: int
    off: int
    grain: int
    rows: int  #: tile height R chosen by the cost model
    empty_fraction: float  #: fraction of g x g blocks the mask leaves empty
    maps: int = 1  #: block map rows (B' x H'): the batch entries / heads planned apart
    covers: bool = False  #: the first calls write every query row (no row is left at 0)
    keep: tuple[torch.Tensor, ...] = ()  #: the spec's tensors, alive while the plan is cached
    partial_fraction: float = 0.0  #: fraction of g x g blocks the mask leaves partial

    @property
    def computed_pairs(self) -> int:
        """(query, key) pairs computed per map row, batch entry and head (allowed and waste)."""
        return sum(c.pairs for c in self.calls)


def _grain(cfg: BlockedConfig, n_maps: int, L: int, S: int) -> int:
    g = cfg.grain
    while n_maps * math.ceil(L / g) * math.ceil(S / g) > cfg.max_map:
        g *= 2
    return g


def _coarsen(state: torch.Tensor, f: int) -> torch.Tensor:
    """Group ``f`` block rows: full only if all are full, empty only if all are empty."""
    if f == 1:
        return state
    nq, nk = state.shape
    pad = (-nq) % f
    lo = torch.cat([state, state.new_full((pad, nk), FULL)]).view(-1, f, nk).amin(1)
    hi = torch.cat([state, state.new_full((pad, nk), EMPTY)]).view(-1, f, nk).amax(1)
    return torch.where(lo == FULL, FULL, torch.where(hi == EMPTY, EMPTY, 1)).to(torch.uint8)


def _runs(state: torch.Tensor) -> list[list[tuple[int, int, int]]]:
    """Run-length code of each row: ``[(first block, end block, state), ...]``."""
    nq, nk = state.shape
    change = torch.ones(nq, nk, dtype=torch.bool, device=state.device)
    change[:, 1:] = state[:, 1:] != state[:, :-1]
    rows, starts = change.nonzero(as_tuple=True)
    codes = state[rows, starts].tolist()
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(nq)]
    rs, ss = rows.tolist(), starts.tolist()
    for i, (r, s, c) in enumerate(zip(rs, ss, codes, strict=True)):
        end = ss[i + 1] if i + 1 < len(rs) and rs[i + 1] == r else nk
        out[r].append((s, end, c))
    return out


def _segments(
    runs: list[tuple[int, int, int]], cfg: BlockedConfig
) -> tuple[tuple[int, int, bool], ...]:
    """``(first block, end block, masked)`` per segment of one row's keys (see module doc)."""
    groups: list[list[tuple[int, int, int]]] = [[]]
    for run in runs:
        if run[2] == EMPTY and run[1] - run[0] >= cfg.empty_split:
            groups.append([])
        else:
            groups[-1].append(run)
    segs: list[tuple[int, int, bool]] = []
    for group in groups:
        while group and group[0][2] == EMPTY:
            group.pop(0)
        while group and group[-1][2] == EMPTY:
            group.pop()
        pending: list[tuple[int, int, int]] = []
        for run in [*group, (0, 0, -1)]:  # a sentinel flushes the last pending runs
            long_full = run[2] == FULL and run[1] - run[0] >= cfg.full_split
            if (long_full or run[2] == -1) and pending:
                masked = any(p[2] != FULL for p in pending)
                segs.append((pending[0][0], pending[-1][1], masked))
                pending = []
            if long_full:
                segs.append((run[0], run[1], False))
            elif run[2] != -1:
                pending.append(run)
    return tuple(segs)


def _kernel_cost(cfg: BlockedConfig, R: int) -> float:
    return next(c for limit, c in cfg.kernel_cost if limit > R)


def _choose_rows(
    cfg: BlockedConfig, state: torch.Tensor, g: int, pair_flops: float, key_bytes: float
) -> int:
    """The tile height R (a multiple of ``g``) with the least estimated cost: pairs computed,
    weighted by how well the fused kernel runs tiles of R rows, plus a cost per call and per
    key row a tile moves through memory (``key_bytes``; the backward's tile gradients)."""
    best, best_cost = g, math.inf
    call_pairs = cfg.call_seconds * cfg.flops / max(pair_flops, 1.0)
    key_pairs = key_bytes / cfg.bandwidth * cfg.flops / max(pair_flops, 1.0)
    for f in (1, 2, 4, 8):
        if f > 1 and (f // 2) >= state.shape[0]:  # taller tiles than the rows there are
            break
        coarse = _coarsen(state, f)
        R = f * g
        nonempty = coarse != EMPTY
        pairs = float(nonempty.sum()) * R * g
        # calls: a row continues the previous row's call when its first non-empty block has
        # moved by the same step and its width is unchanged (a band); otherwise it starts one
        cols = torch.arange(coarse.shape[1], device=coarse.device)
        first = torch.where(nonempty, cols, coarse.shape[1]).amin(1)
        last = torch.where(nonempty, cols, -1).amax(1)
        width, step = last - first, first.diff(prepend=first[:1])
        same = (width[1:] == width[:-1]) & (step[1:] == step[:-1])
        calls = 1 + int((~same).sum())
        cost = pairs * (_kernel_cost(cfg, R) + key_pairs / R) + calls * call_pairs
        if cost < best_cost:
            best, best_cost = R, cost
    return best


@dataclass
class _Item:
    tile: int
    q0: int
    R: int
    k0: int
    W: int
    masked: bool
    first: bool
    alone: bool  #: the tile's only segment (its key window may grow without counting twice)


def _items(cfg: BlockedConfig, state: torch.Tensor, g: int, R: int, L: int, S: int) -> list[_Item]:
    """Tiles of one map row (rows with identical segments merged) and their segments."""
    coarse = _coarsen(state, R // g)
    segs_per_row = [_segments(r, cfg) for r in _runs(coarse)]
    items: list[_Item] = []
    tile = -1
    row = 0
    while row < len(segs_per_row):
        segs = segs_per_row[row]
        end = row + 1
        widest = max(((b - a) * g for a, b, m in segs if m), default=0)
        while (
            end < len(segs_per_row)
            and segs_per_row[end] == segs
            and (end + 1 - row) * R * widest <= cfg.tile_mask_cap
        ):
            end += 1
        q0, q1 = row * R, min(end * R, L)
        if segs:
            tile += 1
        for j, (a, b, masked) in enumerate(segs):
            k0, k1 = a * g, min(b * g, S)
            items.append(_Item(tile, q0, q1 - q0, k0, k1 - k0, masked, j == 0, len(segs) == 1))
        row = end
    return items


def _extends(c: Call, it: _Item) -> bool:
    if (c.first, c.masked, c.W, c.R) != (it.first, it.masked, it.W, it.R):
        return False
    if c.n == 1:  # the second tile sets the steps; rows must not overlap, keys not go back
        return it.q0 - c.q0 >= c.R and it.k0 >= c.k0
    return it.q0 == c.q0 + c.n * c.q_step and it.k0 == c.k0 + c.n * c.k_step


def _widen(cfg: BlockedConfig, items: list[_Item], S: int, call_pairs: float) -> list[_Item]:
    """Give narrow masked items the most common width of their kind where the work that adds
    is small (``widen_waste``) or costs less than the calls it saves: the clipped first
    tiles of a band then run in one call."""
    out = list(items)
    kinds: dict[tuple[bool, int], list[int]] = {}
    for i, it in enumerate(items):
        if it.masked and it.alone:
            kinds.setdefault((it.first, it.R), []).append(i)
    for idx in kinds.values():
        widths = [items[i].W for i in idx]
        common = max(set(widths), key=widths.count)
        narrow = [i for i in idx if common > items[i].W]
        extra = sum(items[i].R * (common - items[i].W) for i in narrow)
        allowed = max(
            cfg.widen_waste * sum(items[i].R * items[i].W for i in idx), len(narrow) * call_pairs
        )
        if not narrow or extra > allowed:
            continue
        for i in narrow:  # grow to the left (earlier keys) first, stay inside [0, S)
            it = items[i]
            k0 = min(max(it.k0 + it.W - common, 0), S - common)
            out[i] = _Item(it.tile, it.q0, it.R, k0, common, True, it.first, True)
    return out


def _calls(
    cfg: BlockedConfig,
    items: list[_Item],
    b: int | None,
    h: int | None,
    S: int,
    call_pairs: float,
) -> list[Call]:
    """Batch items of one shape whose query and key starts step evenly into calls."""
    order = sorted(
        _widen(cfg, items, S, call_pairs),
        key=lambda it: (not it.first, it.masked, it.W, it.R, it.q0, it.k0),
    )
    calls: list[Call] = []
    for it in order:
        c = calls[-1] if calls else None
        if c is not None and _extends(c, it):
            if c.n == 1:
                c.q_step, c.k_step = it.q0 - c.q0, it.k0 - c.k0
            c.n += 1
        else:
            calls.append(Call(b, h, 1, it.R, it.W, it.q0, it.R, it.k0, 0, it.masked, it.first))
    return calls


def tile_index(
    c: Call, start: int, stop: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local query rows ``(m, R, 1)`` and keys ``(m, 1, W)`` of tiles ``start:stop`` of ``c``."""
    t = torch.arange(start, stop, device=device)[:, None, None]
    rows = c.q0 + t * c.q_step + torch.arange(c.R, device=device)[None, :, None]
    keys = c.k0 + t * c.k_step + torch.arange(c.W, device=device)[None, None, :]
    return rows, keys


def allowed(plan: Plan, c: Call, start: int, stop: int, device: torch.device) -> torch.Tensor:
    """Bool ``(m, R, W)``: which pairs of tiles ``start:stop`` of ``c`` the spec allows."""
    assert plan.spec is not None  # a masked call exists only under a spec
    rows, keys = tile_index(c, start, stop, device)
    b = torch.full((1, 1, 1), c.b or 0, dtype=torch.long, device=device)
    h = torch.full((1, 1, 1), c.h or 0, dtype=torch.long, device=device)
    ok = plan.spec.allowed(b, h, rows + plan.q_start, keys + plan.k_start, plan.off)
    return ok.expand(stop - start, c.R, c.W)


def _fill_masks(cfg: BlockedConfig, plan: Plan, device: torch.device) -> None:
    """Evaluate the masks of the masked calls: one per call when the spec is shift-invariant
    over its tiles, else one per tile; beyond ``store_budget`` they are built per call."""
    budget = cfg.store_budget
    for c in plan.calls:
        if not c.masked:
            continue
        chunk = max(1, (1 << 22) // (c.R * c.W))
        first = allowed(plan, c, 0, 1, device)
        shared = True
        parts = [first]
        for s in range(1, c.n, chunk):
            m = allowed(plan, c, s, min(c.n, s + chunk), device)
            parts.append(m)
            shared = shared and bool((m == first).all())
        size = c.R * c.W * (1 if shared else c.n)
        if size > budget:
            c.lazy = True
            continue
        budget -= size
        mask = first if shared else torch.cat(parts)
        c.mask = mask[:, None]  # (n or 1, 1, R, W)
        dead = ~mask.any(-1)  # (n or 1, R)
        c.dead = dead[:, None] if bool(dead.any()) else None


def make_plan(
    spec: MaskSpec | None,
    *,
    L: int,
    S: int,
    q_start: int,
    k_start: int,
    off: int,
    batch: int,
    heads: int,
    pair_flops: float,
    key_bytes: float,
    device: torch.device,
    cfg: BlockedConfig,
) -> Plan:
    """The calls that cover ``L`` query rows against ``S`` keys under ``spec`` (None: all).

    ``pair_flops`` (FLOPs of one (query, key) pair over the batch and heads) and ``key_bytes``
    (memory moved per key row of a tile) weigh pairs, calls and traffic when the tile height
    is chosen: the backward, whose tiles' key gradients overlap, plans taller tiles.
    """
    if L == 0 or S == 0:
        return Plan([], spec, L, S, q_start, k_start, off, cfg.grain, cfg.grain, 1.0)
    if spec is None:
        call = Call(None, None, 1, L, S, 0, L, 0, 0, masked=False, first=True)
        return Plan([call], None, L, S, q_start, k_start, off, cfg.grain, L, 0.0, 1, True)
    g = _grain(cfg, (spec.batch or 1) * (spec.heads or 1), L, S)
    state = block_states(  # (B', H', nq, nk)
        spec, L, S, g, q_start=q_start, k_start=k_start, off=off, device=device
    )
    Bm, Hm = state.shape[0], state.shape[1]
    calls: list[Call] = []
    rows = g
    for bi in range(Bm):
        for hi in range(Hm):
            s = state[bi, hi]
            rows = _choose_rows(cfg, s, g, pair_flops / (Bm * Hm), key_bytes / (Bm * Hm))
            items = _items(cfg, s, g, rows, L, S)
            call_pairs = cfg.call_seconds * cfg.flops * Bm * Hm / max(pair_flops, 1.0)
            b, h = (bi if Bm > 1 else None), (hi if Hm > 1 else None)
            calls += _calls(cfg, items, b, h, S, call_pairs)
    empty = float((state == EMPTY).float().mean())
    written = sum(c.n * c.R for c in calls if c.first)
    plan = Plan(
        calls,
        spec,
        L,
        S,
        q_start,
        k_start,
        off,
        g,
        rows,
        empty,
        Bm * Hm,
        written == L * Bm * Hm,
        tuple(spec.tensors()),
        float((state == PARTIAL).float().mean()),
    )
    _fill_masks(cfg, plan, device)
    return plan
