"""Second derivatives through ring attention on 2 gloo processes, against one process.

The ranks run in one subprocess (``second_order_workers.py``) under a hard timeout. On each
rank: a gradient penalty (the gradients of q, k, v with ``create_graph=True``, then the
gradient of their squared sum) and the Hessian of the rank's loss in its own queries, against
the same quantities of the math backend on the whole sequence in float64, shard by shard.
The ring's backward used to return a second derivative of 0 there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
WORLD = 2
CASES = ("causal_gqa", "window_padding", "selected_per_head")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ring_second_order")
    proc = subprocess.run(
        [sys.executable, str(HERE / "second_order_workers.py"), str(out), str(WORLD)],
        timeout=150,
        capture_output=True,
        text=True,
    )
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    found = []
    for r in range(WORLD):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result\n{log}"
        found.append(json.loads(path.read_text()))
    return found


@pytest.mark.parametrize("case", CASES)
def test_ring_second_derivatives_equal_one_process(ranks: list[dict[str, Any]], case: str) -> None:
    for rank, res in enumerate(ranks):
        got = res[case]
        assert "exception" not in got, got.get("exception")
        assert got["first"] <= 1e-12, f"rank {rank}: gradients off by {got['first']:.3g}"
        assert got["second_size"] > 0.1  # a second derivative of 0 would be far off
        assert got["second"] <= 1e-10, f"rank {rank}: penalty gradient off by {got['second']:.3g}"
        assert got["hessian_size"] > 0.1
        assert got["hessian"] <= 1e-10, f"rank {rank}: Hessian off by {got['hessian']:.3g}"
