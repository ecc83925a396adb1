"""Ring attention on 2 and 4 gloo processes (loopback) against one process; faults; shapes.

All multi-process runs happen in one subprocess (``ring_workers.py``), which imports torch
once and forks each group of ranks; it runs under a hard timeout, and each group is killed
after 60 s, so nothing here can hang. Tolerances (the issue's): float64 <= 1e-9 and
float32 <= 1e-5 in max abs error, for the output and the gradients of q, k and v, against
attnkit.attention on the whole sequence in the same dtype (and, in float64, the oracle).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

HERE = Path(__file__).parent
RUNS = ("correctness:2", "correctness:4", "dies:2", "absent:3")
TOL = {"float64": 1e-9, "float32": 1e-5}
SLACK_S = 3.0  # allowance over the configured timeout on a loaded machine


def _load_workers() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ring_workers", HERE / "ring_workers.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("ring_workers", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


workers = _load_workers()
CASE_NAMES = [c.name for c in workers.CASES]
CASES_BY_NAME = {c.name: c for c in workers.CASES}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("ring")
    proc = subprocess.run(
        [sys.executable, str(HERE / "ring_workers.py"), str(out), *RUNS],
        timeout=280,
        capture_output=True,
        text=True,
    )
    found: dict[str, Any] = {"log": proc.stdout[-3000:] + proc.stderr[-3000:]}
    for run in RUNS:
        name, size = run.split(":")
        d = out / f"{name}-{size}"
        launch = d / "launch.json"
        found[run] = {
            "launch": json.loads(launch.read_text()) if launch.exists() else None,
            "ranks": [
                json.loads(p.read_text()) if (p := d / f"rank{r}.json").exists() else None
                for r in range(int(size))
            ],
        }
    return found


def _ranks(results: dict[str, Any], run: str) -> list[dict[str, Any]]:
    ranks = results[run]["ranks"]
    missing = [r for r, res in enumerate(ranks) if res is None]
    assert not missing, f"{run}: ranks {missing} wrote no result\n{results['log']}"
    return list(ranks)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("world", [2, 4])
def test_ring_equals_one_process(
    results: dict[str, Any], world: int, case: str, dtype: str
) -> None:
    for rank, res in enumerate(_ranks(results, f"correctness:{world}")):
        got = res[f"{case}/{dtype}"]
        assert "exception" not in got, got.get("exception")
        assert got["finite"], f"rank {rank}: NaN or inf"
        for what, err in zip(("out", "dq", "dk", "dv"), got["errors"], strict=True):
            assert err <= TOL[dtype], f"rank {rank}: {what} off by {err:.3g}"
        if dtype == "float64":
            assert got["oracle_error"] <= TOL[dtype]
        spec = CASES_BY_NAME[case]
        want_passes = (
            1 if spec.kv_heads_per_pass is None else -(-spec.Hkv // spec.kv_heads_per_pass)
        )
        assert got["passes"] == want_passes


@pytest.mark.parametrize("world", [2, 4])
def test_zigzag_balances_causal_work_and_skips_invisible_blocks(
    results: dict[str, Any], world: int
) -> None:
    ranks = _ranks(results, f"correctness:{world}")
    pairs = {res["causal/float64"]["pairs"] for res in ranks}
    assert len(pairs) == 1, f"causal chunk pairs per rank differ: {pairs}"
    # every step but the first computes 2 of its 4 pairs; the first computes 3
    assert pairs == {3 + 2 * (world - 1)}
    assert all(res["causal/float64"]["skipped"] == 2 * (world - 1) + 1 for res in ranks)
    assert all(res["causal_window/float64"]["skipped"] > 0 for res in ranks)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", [c for c in CASE_NAMES if c.startswith("selected")])
def test_selected_keys_run_the_gather_kernel_on_every_pair(
    results: dict[str, Any], world: int, case: str
) -> None:
    """Each (query chunk, key chunk) pair of a selected-keys ring runs the gather kernel on
    its own rows and keys (never the tiles' L x S), forward and backward."""
    for res in _ranks(results, f"correctness:{world}"):
        got = res[f"{case}/float32"]
        assert got["pairs"] > 0
        assert got["gather_calls"] == {"forward": got["pairs"], "backward": got["pairs"]}


@pytest.mark.parametrize("world", [2, 4])
def test_shard_unshard_round_trip(results: dict[str, Any], world: int) -> None:
    for res in _ranks(results, f"correctness:{world}"):
        for layout in ("causal=False", "causal=True"):
            assert res["roundtrip"][layout] == {
                "equal": True,
                "positions_match": True,
                "grad_ok": True,
            }


@pytest.mark.parametrize("world", [2, 4])
def test_parallelized_model_equals_one_process(results: dict[str, Any], world: int) -> None:
    for res in _ranks(results, f"correctness:{world}"):
        got = res["module"]
        assert "exception" not in got, got.get("exception")
        assert got["wrapped"] == 2
        assert got["same_keys"]
        assert got["out_error"] <= 1e-9
        assert got["grad_error"] <= 1e-9


@pytest.mark.parametrize("world", [2, 4])
def test_shapes_that_disagree_raise_on_every_rank(results: dict[str, Any], world: int) -> None:
    for rank, res in enumerate(_ranks(results, f"correctness:{world}")):
        got = res["mismatch"]
        assert got["raised"] == "AttentionInputError"
        message = got["message"]
        assert f"the {world} ranks disagree on 'q'" in message
        assert "rank 1: attnkit.distributed.ring_attention torch.float32 q (1, 2, 6, 4)" in message
        assert "rank 0: attnkit.distributed.ring_attention torch.float32 q (1, 2, 8, 4)" in message
        assert f"rank {rank}: " in message
        assert "<- this rank" in message
        assert "attnkit.distributed.shard(x, causal=...)" in message


def test_rank_that_dies_makes_the_others_fail_fast(results: dict[str, Any]) -> None:
    ranks = results["dies:2"]["ranks"]
    assert results["dies:2"]["launch"]["exitcodes"][1] == 17  # rank 1 died as planned
    got = ranks[0]
    assert got is not None, results["log"]
    assert got["raised"] == "RingError"
    assert got["seconds"] <= workers.FAULT_TIMEOUT_S + SLACK_S
    assert "rank 0 of 2 lost rank 1" in got["message"]
    assert "backward step" in got["message"]


def test_rank_that_never_calls_is_named_within_the_timeout(results: dict[str, Any]) -> None:
    ranks = _ranks(results, "absent:3")
    assert ranks[2] == {"absent": True, "worker_seconds": ranks[2]["worker_seconds"]}
    for rank in (0, 1):
        got = ranks[rank]
        assert got["raised"] == "RingError", got
        assert got["seconds"] >= 0.9 * workers.FAULT_TIMEOUT_S
        assert got["seconds"] <= workers.FAULT_TIMEOUT_S + SLACK_S
        assert f"rank {rank} of 3 waited" in got["message"]
        assert "for rank 2 (timeout 4 s)" in got["message"]
        assert "rank 2 has exited, hung, or never made this call" in got["message"]


MASKS_THAT_DIFFER = ("document", "causal_document", "key_mask", "dense", "key_padding_mask")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", MASKS_THAT_DIFFER)
def test_masks_whose_contents_differ_raise_on_every_rank(
    results: dict[str, Any], world: int, case: str
) -> None:
    """Rank 1's mask has the same repr as the others' and other contents (issue 22, item 10):
    every rank raises the same AttentionInputError before any K/V moves (not a RingError
    after the timeout), naming the mask, which ranks hold which digest, and the fix."""
    ranks = _ranks(results, f"correctness:{world}")
    messages = set()
    for rank, res in enumerate(ranks):
        got = res["disagreements"]
        assert "exception" not in got, got.get("exception")
        assert got[case]["raised"] == "AttentionInputError", got[case]
        message = got[case]["message"]
        assert f"the {world} ranks disagree on 'mask'" in message
        assert re.search(rf"rank {rank}: [^\n]*  <- this rank\n", message)
        assert "this rank's mask: " in message
        assert "shard the data, never the mask" in message
        messages.add(message.replace("  <- this rank", ""))  # the same on every rank
    assert len(messages) == 1
    assert "exception" not in ranks[0]["disagreements"]["digests"]
    digests = [res["disagreements"]["digests"].get(case) for res in ranks]
    if digests[0] is not None:  # the specs the test built (SequenceParallel builds its own)
        mine, theirs = digests[1][:16], digests[0][:16]
        assert mine != theirs
        assert all(d[:16] == theirs for r, d in enumerate(digests) if r != 1)
        others = [str(r) for r in range(world) if r != 1]
        who = f"ranks {', '.join(others[:-1])} and {others[-1]} have" if world > 2 else "rank 0 has"
        assert f"{who} mask=#{theirs}; rank 1 has mask=#{mine}." in messages.pop()


@pytest.mark.parametrize("world", [2, 4])
def test_scales_that_differ_in_the_last_bits_raise_and_equal_masks_pass(
    results: dict[str, Any], world: int
) -> None:
    for res in _ranks(results, f"correctness:{world}"):
        got = res["disagreements"]
        assert got["scale"]["raised"] == "AttentionInputError", got["scale"]
        message = got["scale"]["message"]
        assert f"the {world} ranks disagree on 'scale'" in message
        assert "rank 1 has scale=0.500000000001" in message
        assert "pass the same scale= on every rank" in message
        # equal contents in tensors built apart, with a user's spec holding a function
        assert got["same"] == {"raised": None, "message": ""}
