"""``with attnkit.distributed.profile() as prof: ...`` records each ring step on this rank.

For every step of every ring pass (forward and backward; one pass per group of heads) it
records the compute time (CPU time of this process, so that ranks sharing cores are compared by
the work they did), the wall time spent waiting for the neighbour, the bytes sent, and the block
pairs computed and skipped.
With no profile active the ring checks one empty list and records nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["RingProfile", "RingStep", "active_profile", "profile"]

_ACTIVE: list[RingProfile] = []


@dataclass(frozen=True)
class RingStep:
    """One step of one ring pass on this rank."""

    phase: str  # "forward" or "backward"
    part: int  # the pass: which group of heads went around the ring (0 when all at once)
    step: int  # 0 .. world-1; at step s rank r works on the K/V block of rank (r - s) % world
    source: int  # the rank whose K/V block this step used
    compute_s: float  # CPU seconds spent computing (process time)
    compute_wall_s: float  # wall seconds spent computing
    wait_s: float  # wall seconds spent waiting for messages after computing
    bytes_sent: int  # bytes this rank sent in this step
    pairs: int  # (query chunk, key chunk) pairs computed
    skipped: int  # pairs skipped because the mask leaves them empty


@dataclass
class RingProfile:
    """The steps recorded on this rank while the profile was active, in order."""

    steps: list[RingStep] = field(default_factory=list)

    def total(self, attr: str, phase: str | None = None) -> float:
        """Sum of one field (``"compute_s"``, ``"bytes_sent"``, ...) over the steps."""
        return float(sum(getattr(s, attr) for s in self.steps if phase in (None, s.phase)))

    def __str__(self) -> str:
        head = (
            f"{'phase':<9}{'pass':>5}{'step':>5}{'source':>7}{'compute s':>11}{'wall s':>9}"
            f"{'wait s':>9}{'MiB sent':>10}{'pairs':>7}{'skipped':>8}"
        )
        rows = [
            f"{s.phase:<9}{s.part:>5}{s.step:>5}{s.source:>7}{s.compute_s:>11.3f}{s.compute_wall_s:>9.3f}"
            f"{s.wait_s:>9.3f}{s.bytes_sent / 2**20:>10.2f}{s.pairs:>7}{s.skipped:>8}"
            for s in self.steps
        ]
        return "\n".join([head, *rows])


def active_profile() -> RingProfile | None:
    """The innermost profile active on this rank (the one the ring records into), or ``None``."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def profile() -> Iterator[RingProfile]:
    """Record the ring steps of this rank inside the ``with`` block.

    >>> with profile() as prof:
    ...     pass  # ring_attention(...) calls here are recorded
    >>> prof.steps
    []
    """
    prof = RingProfile()
    _ACTIVE.append(prof)
    try:
        yield prof
    finally:
        _ACTIVE.remove(prof)
