"""attnkit bench: end to end on a tiny run (every output format), exact FLOP counting of the
allowed pairs, the acceptance checks, row selection, skips with reasons, and lazy imports.

No timing is asserted: the numbers of a run are only checked to exist and be consistent.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from attnkit import bench
from attnkit.bench import runner
from attnkit.bench.peers import PEERS
from attnkit.bench.report import acceptance
from attnkit.bench.runner import BenchResult, Entry, Row
from attnkit.bench.workloads import BACKWARD_FACTOR, WORKLOADS, allowed_pairs
from attnkit.cli import app


def test_a_tiny_run_end_to_end_writes_table_json_markdown_and_plot(tmp_path: Path) -> None:
    rows = [("dense", 128, "float32", "fwd"), ("window", 384, "float32", "fwd+bwd")]
    seen: list[tuple[str, int, int]] = []
    result = bench.run(
        rows,
        peers=["sdpa", "attnkit", "flex"],
        reps=5,
        gemm=50.0,
        gemm_n=256,
        progress=lambda label, done, total: seen.append((label, done, total)),
    )
    assert [r.label for r in result.rows] == [
        "dense L=128 float32 fwd",
        "window L=384 float32 fwd+bwd",
    ]
    assert seen[-1][1] == seen[-1][2]
    assert seen[0][1] == 0
    for row in result.rows:
        by_peer = {e.peer: e for e in row.entries}
        for name in ("sdpa", "attnkit"):
            e = by_peer[name]
            assert e.error is None, e.error
            assert e.ms is not None
            assert len(e.times_ms) == 5
            assert e.gflops == pytest.approx(row.flops / (e.ms / 1e3) / 1e9)
            assert row.gemm_gflops is not None  # timed in the same rounds as the peers
            assert e.gemm_fraction == pytest.approx(e.gflops / row.gemm_gflops)
            assert e.peak_mib is not None
            assert e.peak_mib >= 0
            assert e.x_best_peer is not None
        assert by_peer["sdpa"].x_best_peer == 1.0  # the only outside peer that ran
        assert by_peer["flex"].ms is None
        assert by_peer["flex"].skipped
    assert "one 128 x 128 block" in str(result.rows[0].entries[0].skipped)
    assert "no backward" in str(result.rows[1].entries[0].skipped)
    bench.write_json(result, tmp_path / "b.json")
    bench.write_markdown(result, tmp_path / "b.md")
    bench.write_plot(result, tmp_path / "b.png")
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["gemm_gflops"] == 50.0
    assert data["reps"] == 5
    assert data["machine"]["threads"] == torch.get_num_threads()
    assert {e["peer"] for e in data["rows"][1]["entries"]} == {"sdpa", "attnkit", "flex"}
    kept = tmp_path / "kept.md"
    kept.write_text(
        "# prose\n<!-- attnkit bench: start -->\nold\n<!-- attnkit bench: end -->\ntail\n"
    )
    bench.write_markdown(result, kept)
    text = kept.read_text()
    assert text.startswith("# prose\n<!-- attnkit bench: start -->\n**Machine:** ")
    assert text.endswith("<!-- attnkit bench: end -->\ntail\n")
    assert "old" not in text
    md = (tmp_path / "b.md").read_text()
    assert md.startswith("**Machine:** ")
    assert "| window L=384 float32 fwd+bwd | attnkit |" in md
    assert "### Who wins where" in md
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_cli_runs_and_writes_its_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "measure_gemm", lambda: 40.0)  # the real one takes seconds
    out = tmp_path / "r.json"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--quick",
            "--no-memory",
            "-w",
            "causal",
            "-L",
            "200",
            "--dtype",
            "float32",
            "--mode",
            "fwd",
            "-p",
            "sdpa",
            "-p",
            "attnkit",
            "--json",
            str(out),
            "--markdown",
            str(tmp_path / "r.md"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "causal L=200 float32 fwd" in result.output
    assert f"wrote {out}" in result.output
    rows = json.loads(out.read_text())["rows"]
    assert [e["peer"] for e in rows[0]["entries"]] == ["sdpa", "attnkit"]
    assert "| causal L=200 float32 fwd | sdpa |" in (tmp_path / "r.md").read_text()
    bad = CliRunner().invoke(app, ["bench", "-p", "nonsense", "-w", "dense", "-L", "64"])
    assert bad.exit_code != 0


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("L", [97, 300])
def test_flops_count_allowed_pairs_exactly(name: str, L: int) -> None:
    wl = WORKLOADS[name]
    Lq, S = wl.sizes(L)
    spec, _ = wl.spec(Lq, S)
    exact = (
        wl.B * Lq * S if spec is None else int(spec.to_dense(Lq, S).expand(wl.B, 1, Lq, S).sum())
    )
    assert allowed_pairs(spec, Lq, S, wl.B) == exact
    proj = 4 * 2.0 * wl.B * Lq * (wl.H * wl.D) ** 2 if wl.module else 0.0
    assert wl.flops(L, backward=False) == 4.0 * wl.D * wl.H * exact + proj
    assert wl.flops(L, backward=True) == BACKWARD_FACTOR * wl.flops(L, backward=False)


def test_workloads_are_what_they_say() -> None:
    pad, _ = WORKLOADS["padding"].spec(1000, 1000)
    assert allowed_pairs(pad, 1000, 1000, 2) == 0.75 * 2 * 1000 * 1000  # 25% of keys padded
    doc, _ = WORKLOADS["document"].spec(4096, 4096)
    assert doc is not None
    assert "document" in repr(doc)
    ids = doc.tensors()[0]
    assert int(ids.max()) == 7  # 8 documents
    inputs = WORKLOADS["gqa"].inputs(64, torch.float32)
    assert inputs.q.shape[1] == 32
    assert inputs.k.shape[1] == 8
    assert WORKLOADS["decode"].inputs(64, torch.bfloat16).q.shape == (1, 8, 1, 64)
    again = WORKLOADS["window"].inputs(64, torch.float32)  # seeded: every process agrees
    assert torch.equal(again.q, WORKLOADS["window"].inputs(64, torch.float32).q)


def _entry(peer: str, ms: float, **kw: float) -> Entry:
    return Entry(peer, ms=ms, **kw)  # type: ignore[arg-type]


def test_acceptance_checks_read_the_rows() -> None:
    rows = [
        Row(
            "dense", 4096, "float32", "fwd", 1.0, [_entry("sdpa", 100.0), _entry("attnkit", 104.0)]
        ),
        Row(
            "causal", 4096, "float32", "fwd", 1.0, [_entry("sdpa", 100.0), _entry("attnkit", 110.0)]
        ),
        Row(
            "window",
            16384,
            "float32",
            "fwd",
            1.0,
            [
                _entry("sdpa", 1000.0),
                _entry("flex", 120.0),
                _entry("attnkit", 90.0, gemm_fraction=0.55),
            ],
        ),
    ]
    result = BenchResult({}, 100.0, rows, 5)
    verdicts = {c.what: c.passed for c in acceptance(result)}
    assert verdicts["dense L=4096: auto time / SDPA time"] is True
    assert verdicts["causal L=4096: auto time / SDPA time"] is False
    assert verdicts["window 256, L=16384 fwd: SDPA (dense mask) / auto"] is True
    assert verdicts["window 256, L=16384 fwd: flex (warm) / auto"] is False  # 1.33x
    assert verdicts["window 256, L=16384 fwd: auto useful GFLOP/s / GEMM"] is True
    assert verdicts["8 documents, L=16384 fwd: SDPA (dense mask) / auto"] is None  # not run
    md = bench.to_markdown(result)
    assert (
        "| causal L=4096: auto time / SDPA time | causal L=4096 float32 fwd | 1.1 | <= 1.05 "
        "| **FAIL** |" in md
    )


def test_row_selection() -> None:
    assert bench.plan_rows() == bench.ACCEPTANCE_ROWS
    assert ("window", 16384, "float32", "fwd+bwd") in bench.plan_rows()
    assert all(r[1] <= 2048 for r in bench.plan_rows(quick=True))
    picked = bench.plan_rows(workloads=["causal"], lengths=[1024], dtypes=["bfloat16"])
    assert picked == [("causal", 1024, "bfloat16", "fwd"), ("causal", 1024, "bfloat16", "fwd+bwd")]
    full = bench.plan_rows(full=True)
    assert len(full) == len(WORKLOADS) * 4 * 2 * 2


def test_peers_say_why_they_skip() -> None:
    dense, window = WORKLOADS["dense"], WORKLOADS["window"]
    assert "GiB" in str(PEERS["naive"].skip(dense, 65536, torch.float32, False, 8 << 30))
    assert "dense mask" in str(PEERS["sdpa"].skip(window, 65536, torch.float32, False, 8 << 30))
    assert PEERS["sdpa"].skip(WORKLOADS["causal"], 65536, torch.float32, True, 8 << 30) is None
    assert "no backward" in str(PEERS["flex"].skip(window, 4096, torch.float32, True, 8 << 30))
    assert PEERS["torch-mha"].skip(dense, 64, torch.float32, False, 8 << 30) == "module rows only"
    assert PEERS["attnkit"].skip(window, 65536, torch.float32, True, 8 << 30) is None
    with pytest.raises(ValueError, match="unknown peers"):
        bench.run([("dense", 64, "float32", "fwd")], peers=["nonsense"])


def test_measure_gemm_and_lazy_imports() -> None:
    assert runner.measure_gemm(n=128, reps=5) > 0
    code = (
        "import sys, attnkit.cli, attnkit.bench; "
        "print('matplotlib' in sys.modules, 'torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
