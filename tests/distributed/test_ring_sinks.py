"""Ring attention with attention sinks on 2 and 4 gloo processes (loopback) against one process.

The ranks run in one subprocess (``ring_sinks_workers.py``, which forks each group with
ring_workers.py's launcher) under a hard timeout, so nothing here can hang. Sinks per head
``(H,)`` (the same on every rank) and per token ``(B, H, Lq)`` / ``(1, H, Lq)`` (each rank its
query rows') join each row's softmax once, after the merge over every key shard: a sink joined
once per ring step would be counted ``P`` times and miss by far more than the tolerances.
Tolerances (as tests/distributed/test_ring.py): float64 <= 1e-9 and float32 <= 1e-5 in max abs
error, for the output and the gradients of q, k, v and the sinks (the per-head sinks' gradient
summed over the ranks, as for every replicated parameter), against attnkit.attention on the
whole sequence in the same dtype and, in float64, the oracle.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
WORLDS = (2, 4)
TOL = {"float64": 1e-9, "float32": 1e-5}

sys.path.insert(0, str(HERE))
from ring_sink_cases import KINDS, SINK_CASES  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("ring_sinks")
    proc = subprocess.run(
        [sys.executable, str(HERE / "ring_sinks_workers.py"), str(out), *map(str, WORLDS)],
        timeout=200,
        capture_output=True,
        text=True,
    )
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    found = {}
    for world in WORLDS:
        ranks = []
        for r in range(world):
            path = out / f"sinks-{world}" / f"rank{r}.json"
            assert path.exists(), f"world {world}: rank {r} wrote no result\n{log}"
            ranks.append(json.loads(path.read_text()))
        found[world] = ranks
    return found


def _got(results: dict[int, list[dict[str, Any]]], world: int, key: str) -> list[dict[str, Any]]:
    got = [res[key] for res in results[world]]
    for rank, one in enumerate(got):
        assert "exception" not in one, f"rank {rank}: {one['exception']}"
    return got


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", SINK_CASES)
@pytest.mark.parametrize("world", WORLDS)
def test_ring_with_sinks_equals_one_process(
    results: dict[int, list[dict[str, Any]]], world: int, case: str, kind: str, dtype: str
) -> None:
    for rank, got in enumerate(_got(results, world, f"{case}/{kind}/{dtype}")):
        assert got["finite"], f"rank {rank}: NaN or inf"
        for what, err in zip(("out", "dq", "dk", "dv", "dsinks"), got["errors"], strict=True):
            assert err <= TOL[dtype], f"rank {rank}: {what} off by {err:.3g}"
        if dtype == "float64":
            assert got["oracle_error"] <= TOL[dtype]
        assert len(got["dsinks_shape"]) == {"H": 1, "BHL": 3, "1HL": 3}[kind]
        assert got["passes"] == (2 if case == "causal_headwise" else 1)


@pytest.mark.parametrize("world", WORLDS)
def test_parallelized_stack_with_learned_sinks_equals_one_process(
    results: dict[int, list[dict[str, Any]]], world: int
) -> None:
    for got in _got(results, world, "module"):
        assert got["same_keys"]  # the wrapper shares the module's sinks: the same state_dict
        assert got["out_error"] <= 1e-9
        assert got["grad_error"] <= 1e-9
        assert got["sinks_grad_error"] <= 1e-9


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["H", "BHL"])
def test_second_derivatives_with_sinks_equal_one_process(
    results: dict[int, list[dict[str, Any]]], world: int, kind: str
) -> None:
    for got in _got(results, world, "second_order"):
        assert got[kind]["size"] > 0.1  # a second derivative of 0 would be far off
        assert got[kind]["dq"] <= 1e-10
        assert got[kind]["dsinks"] <= 1e-10


@pytest.mark.parametrize("world", WORLDS)
def test_per_token_sinks_of_the_whole_sequence_are_refused_with_the_fix(
    results: dict[int, list[dict[str, Any]]], world: int
) -> None:
    N = 8 * world
    for got in _got(results, world, "refusals"):
        err = got["whole_sequence"]
        assert err["raised"] == "AttentionInputError"
        assert "these per-token sinks cover the whole sequence" in err["message"]
        assert (
            f"sinks (B=2, H=2, L={N})  q (B=2, H=2, Lq=8) on each of {world} ranks"
            in (err["message"])
        )
        assert "shard(sinks.unsqueeze(-1), causal=...).squeeze(-1)" in err["message"]
        err = got["shape"]
        assert err["raised"] == "AttentionInputError"
        assert "`sinks` has shape (3,); it holds one logit per query head." in err["message"]
        assert "expected: sinks (H=2,) or (B=2, H=2, L=8) or (1, H=2, L=8)" in err["message"]
        err = got["module_both"]
        assert err["raised"] == "AttentionInputError"
        assert err["message"].startswith("attnkit.distributed.SequenceParallel: this module has")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    ("case", "rank1"),
    [
        ("values", "sinks=#"),
        ("presence", "sinks=None"),
        ("per_token_and_per_head", "sinks=per-token"),
    ],
)
def test_sinks_that_differ_between_ranks_raise_on_every_rank(
    results: dict[int, list[dict[str, Any]]], world: int, case: str, rank1: str
) -> None:
    """Rank 1 passes other per-head sinks (the last bits of one value), none, or per-token
    sinks: every rank raises the same AttentionInputError before any K/V moves."""
    messages = set()
    for rank, got in enumerate(_got(results, world, "refusals")):
        err = got[case]
        assert err["raised"] == "AttentionInputError", err
        message = err["message"]
        assert f"the {world} ranks disagree on 'sinks'" in message
        assert f"rank 1 has {rank1}" in message
        assert re.search(rf"rank {rank}: [^\n]* sinks=[^\n]*  <- this rank\n", message)
        assert "pass the same sinks parameter on every rank" in message
        messages.add(message.replace("  <- this rank", ""))
    assert len(messages) == 1
