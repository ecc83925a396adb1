"""The CUDA tier: ``attnkit bench --device cuda`` end to end on a small row (marked ``cuda``).

No timing is asserted: the numbers are checked to exist and be consistent, and ``auto``'s
backend to be flex for the window.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attnkit.cli import app

pytestmark = pytest.mark.cuda


def test_the_cuda_bench_writes_its_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "cuda.json"
    md = tmp_path / "cuda.md"
    args = ["bench", "--device", "cuda", "-w", "window", "-L", "2048", "--dtype", "bfloat16"]
    args += ["--mode", "fwd", "--mode", "fwd+bwd", "--reps", "5"]
    result = CliRunner().invoke(app, [*args, "--json", str(out), "--markdown", str(md)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["gemm_tflops"] > 0
    assert [(r["workload"], r["mode"]) for r in data["rows"]] == [
        ("window", "fwd"),
        ("window", "fwd+bwd"),
    ]
    for row in data["rows"]:
        peers = {e["peer"]: e for e in row["entries"]}
        assert list(peers) == ["sdpa", "flex", "attnkit"]
        for e in peers.values():
            assert e["ms"] > 0, e
            assert e["tflops"] > 0, e
            assert e["of_peak"] == pytest.approx(e["tflops"] / data["gemm_tflops"])
            assert e["peak_mib"] is not None, e
        assert "auto: flex" in peers["attnkit"]["note"]
    assert "| window L=2048 bfloat16 fwd+bwd | attnkit |" in md.read_text()
