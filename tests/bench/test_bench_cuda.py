"""``attnkit bench --device cuda`` without a GPU: one line saying why, before any work; every
option it does not take refused the same way; and its measurement code run on the CPU (the same
code path with the wall clock, no memory figure), so its table and FLOP count are checked here.

The GPU run itself is tests/cuda/test_cuda_bench.py (marked ``cuda``). No timing is asserted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from attnkit.bench import cuda
from attnkit.bench.report import to_markdown, write_json, write_markdown
from attnkit.bench.results import BenchResult, Entry, Row
from attnkit.bench.workloads import WORKLOADS, gpu_workload
from attnkit.cli import app


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine without a GPU, whatever this one has; and nothing may be measured."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cuda, "measure_gemm", lambda *a, **k: pytest.fail("it measured"))


def _one_line(args: list[str]) -> str:
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("attnkit: error: ")
    return lines[0]


@pytest.mark.usefixtures("no_gpu")
def test_without_a_gpu_the_cuda_bench_says_why_in_one_line() -> None:
    line = _one_line(["--device", "cuda", "-w", "window", "-L", "2048"])
    assert "--device cuda needs an NVIDIA GPU that torch can see: " in line
    assert f"torch.cuda.is_available() is False (torch {torch.__version__}, " in line
    assert "(fix: run it on a GPU machine (docs/cuda.md: make bench-cuda)" in line
    with pytest.raises(cuda.AttentionInputError, match="needs an NVIDIA GPU"):
        cuda.run_cuda()  # the library refuses the same way


BAD = [
    (["--device", "tpu"], "--device tpu is not one the CUDA bench runs"),
    (["--device", "cuda", "--quick"], "--quick belongs to the CPU bench"),
    (["--device", "cuda", "--plot", "p.png"], "--plot belongs to the CPU bench"),
    (["--device", "cuda", "--full"], "--full belongs to the CPU bench"),
    (["--device", "cuda", "--no-memory"], "--no-memory belongs to the CPU bench"),
    (["--device", "cuda", "-w", "decode"], "--workload decode is not one the CUDA bench runs"),
    (
        ["--device", "cuda", "--dtype", "float64"],
        "runs (expected one of float32, bfloat16, float16)",
    ),
    (["--device", "cuda", "-L", "64"], "--length 64 is not one the CUDA bench runs"),
    (["--device", "cuda", "-p", "naive"], "--peer naive is not one the CUDA bench runs"),
    (["--device", "cuda", "--reps", "2"], "--reps must be at least 5"),
]


@pytest.mark.parametrize(("args", "part"), BAD, ids=[" ".join(a) for a, _ in BAD])
@pytest.mark.usefixtures("no_gpu")
def test_options_the_cuda_bench_does_not_take_are_refused_first(args: list[str], part: str) -> None:
    assert part in _one_line(args)


def test_the_measurement_runs_on_the_cpu_and_counts_allowed_pairs() -> None:
    rows = [("window", 256, "float32", "fwd"), ("document", 512, "float32", "fwd")]
    result = cuda.run_cuda(rows, peers=["sdpa", "attnkit"], reps=5, gemm_n=256, device="cpu")
    assert result.gemm_gflops > 0
    assert [(r.workload, r.L) for r in result.rows] == [("window", 256), ("document", 512)]
    window = result.rows[0]
    pairs = 256 * 257 // 2  # a window of 1024 over 256 causal rows: every causal pair
    for e in window.entries:
        assert e.ms is not None
        assert e.gflops is not None
        assert e.gemm_fraction is not None
        assert e.gflops * e.ms / 1e3 * 1e9 == pytest.approx(4 * 128 * 16 * pairs)
        assert e.gemm_fraction == pytest.approx(e.gflops / result.gemm_gflops)
        assert e.peak_mib is None  # measured on a GPU only
        assert "first call" in e.note
    assert "auto: " in window.entries[1].note
    table = to_markdown(result)
    assert "| window L=256 float32 fwd | sdpa |" in table
    assert "| document L=512 float32 fwd | attnkit |" in table


def test_the_document_mask_is_the_cpu_bench_s() -> None:
    ref, _ = WORKLOADS["document"].spec(4096, 4096)
    mine, causal = gpu_workload("document").spec(4096, 4096, "cpu")
    assert not causal
    assert mine is not None
    assert ref is not None
    assert torch.equal(mine.to_dense(4096, 4096), ref.to_dense(4096, 4096))


def test_a_gpu_result_is_shown_and_written_in_the_gpu_bench_s_layout(tmp_path: Path) -> None:
    """The GPU bench's result is the CPU bench's type; the report gives it its own table and
    JSON (TFLOP/s against the bf16 GEMM, the time over SDPA's and flex's, the note)."""
    ran = Entry("sdpa", ms=2.0, gflops=500.0, gemm_fraction=0.5, peak_mib=3.0, note="is_causal")
    row = Row("causal", 2048, "bfloat16", "fwd", 1e12, [ran, Entry("flex", skipped="no flex")])
    machine = {"device": "H100", "torch": "2.x", "cuda": "12.4"}
    result = BenchResult(machine, 1000.0, [row], 5, device="cuda")
    write_json(result, tmp_path / "c.json")
    write_markdown(result, tmp_path / "c.md")
    assert json.loads((tmp_path / "c.json").read_text()) == {
        **machine, "gemm_tflops": 1.0, "reps": 5,
        "rows": [{
            "workload": "causal", "L": 2048, "dtype": "bfloat16", "mode": "fwd",
            "entries": [
                {"peer": "sdpa", "ms": 2.0, "tflops": 0.5, "of_peak": 0.5, "peak_mib": 3.0,
                 "note": "is_causal"},
                {"peer": "flex", "ms": None, "tflops": None, "of_peak": None, "peak_mib": None,
                 "note": "no flex"},
            ],
        }],
    }  # fmt: skip
    assert (tmp_path / "c.md").read_text().splitlines() == [
        "**GPU:** H100; torch 2.x (CUDA 12.4); bf16 GEMM 1 TFLOP/s; median of 5 interleaved "
        "calls (CUDA events)",
        "",
        "| row | peer | ms | TFLOP/s | of GEMM | peak MiB | vs sdpa | vs flex | note |",
        "|---|---|---|---|---|---|---|---|---|",
        "| causal L=2048 bfloat16 fwd | sdpa | 2.00 | 0.5 | 50% | 3 | 1.00 | - | is_causal |",
        "| causal L=2048 bfloat16 fwd | flex | - | - | - | - | - | - | no flex |",
    ]
