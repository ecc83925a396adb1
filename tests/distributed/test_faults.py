"""A peer that fails gives RingError whatever the backend's message, wherever it surfaces.

gloo reports a dead peer either from ``wait`` (torch 2.13 here: tests/distributed/test_ring.py's
``dies`` scenario) or already when the request is posted (torch 2.11); and its text differs
between versions. Here both places raise a RuntimeError with a text no code matches on.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import attnkit.distributed as akd
from attnkit.distributed import faults

NEVER_SEEN = "[../gloo/x.cc:1] some backend text attnkit never matches on"


@pytest.fixture
def group_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _refuse(*args: object, **kwargs: object) -> list[dist.Work]:
    raise RuntimeError(NEVER_SEEN)


class _Fails:
    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        raise dist.DistError(NEVER_SEEN)  # a RuntimeError subclass, as newer torch raises


def test_a_request_refused_at_posting_raises_ring_error_on_wait(
    group_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dist, "batch_isend_irecv", _refuse)
    t = torch.zeros(3)
    pending = faults.exchange([t], [torch.empty(3)], group=None, rank=0, world=2, tag=1)
    assert [type(w) for w, _ in pending] == [faults.Refused]
    with pytest.raises(akd.RingError) as info:
        faults.wait_all(
            pending, timeout=timedelta(seconds=5), where="w", rank=0, world=2, what="a step"
        )
    assert info.value.peers == (1,)
    assert "rank 0 of 2 lost rank 1" in str(info.value)
    assert "cause: some backend text attnkit never matches on" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_request_that_fails_on_wait_raises_ring_error() -> None:
    with pytest.raises(akd.RingError, match=r"rank 1 of 3 lost rank 2 .* while a step"):
        faults.wait_all(
            [(_Fails(), (2,))], timeout=timedelta(seconds=5), where="w", rank=1, world=3,
            what="a step",
        )  # fmt: skip


def test_ring_attention_turns_a_refused_post_into_ring_error(
    group_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the public call: every exchange of the ring goes through the same two places."""
    monkeypatch.setattr(dist, "batch_isend_irecv", _refuse)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(akd.RingError, match="lost rank"):
        akd.ring_attention(q, q, q, causal=True, timeout=5)
