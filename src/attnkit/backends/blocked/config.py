"""The ``blocked`` backend's knobs, in one frozen config that is part of every plan's key.

Change them for a process with :func:`configure` (tests and benchmarks do); plans made under
other settings are never reused, because the config is in the cache key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

__all__ = ["CONFIG", "BlockedConfig", "configure", "current"]


@dataclass(frozen=True)
class BlockedConfig:
    """Planner and launch settings (calibrated on 2 cores with ``attnkit bench``)."""

    #: block map grain (rows and keys); doubles for huge maps, see ``max_map``
    grain: int = 32
    #: block map entries (B' x H' x nq x nk) before the grain doubles
    max_map: int = 1 << 22
    #: a run of at least this many empty key blocks splits a row's keys
    empty_split: int = 2
    #: a run of at least this many full key blocks gets its own unmasked call
    full_split: int = 16
    #: extra work allowed to widen narrow masked items into a common width
    widen_waste: float = 0.05
    #: mask elements (R x W) of one masked item before a tile is split
    tile_mask_cap: int = 1 << 22
    #: mask elements a plan keeps; beyond it masks are built per call
    store_budget: int = 1 << 26
    #: relative cost per (query, key) pair by tile height R: torch's fused CPU kernel splits
    #: the queries of a call in 32 rows below 192, 64 below 768, 256 above
    kernel_cost: tuple[tuple[int, float], ...] = ((192, 1.3), (768, 1.1), (1 << 62, 1.0))
    #: overhead of one kernel call (Python, views, merge) in seconds, the assumed attention
    #: throughput (FLOP/s) and memory bandwidth (B/s): weigh calls and traffic against pairs
    call_seconds: float = 200e-6
    flops: float = 5e10
    bandwidth: float = 3e9
    #: the backward writes (and zeroes) the key and value gradients of every tile, read back to
    #: be summed: bytes moved per key row of a tile, per (Dk + Dv) and head
    backward_key_bytes: int = 16
    #: bytes of kernel outputs (tile gradients) per backward launch
    tile_bytes: int = 64 << 20
    #: the same for the forward (outputs and lse): small launches reuse the allocator's memory
    #: instead of page-faulting fresh outputs (about 15% faster for a 256-window band)
    forward_tile_bytes: int = 16 << 20
    #: run tiles on torch's fused CPU flash kernel where it applies (else the matmul kernel)
    torch_kernel: bool = True
    #: ``auto`` takes ``blocked`` for a mask spec once L x S reaches this (below, one fused call
    #: on the materialised mask is as fast)
    min_pairs: int = 128 * 128
    #: plans kept (least recently used dropped)
    plan_cache_size: int = 32


#: the settings in force (replace it with :func:`configure`, or monkeypatch it in a test)
CONFIG = BlockedConfig()


def current() -> BlockedConfig:
    """The settings in force."""
    return CONFIG


def configure(**changes: object) -> BlockedConfig:
    """Replace some settings (by field name); returns the previous config, for restoring.

    >>> import dataclasses
    >>> old = configure(grain=16)
    >>> current().grain
    16
    >>> _ = configure(**dataclasses.asdict(old))
    >>> current() == old
    True
    """
    global CONFIG
    names = {f.name for f in fields(BlockedConfig)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise TypeError(f"unknown blocked settings {unknown}; known: {sorted(names)}")
    old = CONFIG
    CONFIG = replace(old, **changes)  # type: ignore[arg-type]
    return old
