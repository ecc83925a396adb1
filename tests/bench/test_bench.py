"""attnkit bench: end to end on a tiny run (every output format), exact FLOP counting of the
allowed pairs, the acceptance checks, row selection, skips with reasons, lazy imports, and every
bad option refused in one line before anything is measured.

No timing is asserted: the numbers of a run are only checked to exist and be consistent.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from attnkit import AttentionInputError, bench
from attnkit.bench import machine, runner, worker
from attnkit.bench.machine import bf16_class, cpu_features, describe_features
from attnkit.bench.peers import PEERS
from attnkit.bench.results import BenchResult, Entry, Row, acceptance, criteria
from attnkit.bench.workloads import BACKWARD_FACTOR, WORKLOADS, Inputs, allowed_pairs
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
            assert 1 <= e.calls <= 16  # microsecond calls: repeated to fill 50 ms a round
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
    assert data["min_call_ms"] == 50.0
    assert all(e["calls"] >= 1 for e in data["rows"][0]["entries"] if e["ms"] is not None)
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


def test_masks_workloads_are_what_they_say() -> None:
    equal, _ = WORKLOADS["document-equal"].spec(4096, 4096)
    assert equal is not None
    ids = equal.tensors()[0].flatten()
    assert torch.bincount(ids).tolist() == [512] * 8  # 8 documents of equal length
    uneven, _ = WORKLOADS["document"].spec(4096, 4096)
    assert uneven is not None
    assert len(set(torch.bincount(uneven.tensors()[0].flatten()).tolist())) > 1
    inputs = WORKLOADS["gqa-window"].inputs(600, torch.float32)
    assert (inputs.q.shape[1], inputs.k.shape[1]) == (32, 8)
    assert not inputs.causal  # a window, not torch's is_causal
    window, _ = WORKLOADS["window"].spec(600, 600)
    assert inputs.spec is not None
    assert window is not None
    assert torch.equal(inputs.spec.to_dense(600, 600), window.to_dense(600, 600))
    assert allowed_pairs(inputs.spec, 600, 600, 1) == 256 * 600 - 255 * 256 // 2


def test_each_row_has_its_default_peers() -> None:
    assert bench.row_peers("window", 16384, "float32") == [
        "sdpa",
        "flex",
        "attnkit",
        "attnkit-blocked",
    ]  # naive only up to 8 heads x 4k x 4k
    assert bench.row_peers("causal", 4096, "float32")[0] == "naive"
    # a dense mask at 32 heads x 16k would take SDPA minutes a call: flex is the outside peer
    assert bench.row_peers("gqa-window", 16384, "float32") == ["flex", "attnkit"]
    assert bench.row_peers("document-equal", 16384, "float32") == ["sdpa", "flex", "attnkit"]
    assert bench.row_peers("causal", 4096, "bfloat16") == [
        "sdpa",
        "flex",
        "attnkit",
        "attnkit-blocked",
        "attnkit-fp32",
    ]  # bfloat16 rows: attnkit's own float32 on the same call, which the masks bars compare with
    assert bench.row_peers("module", 512, "float32") == ["torch-mha", "attnkit-mha"]
    why = PEERS["attnkit-fp32"].skip(WORKLOADS["window"], 64, torch.float32, False, 8 << 30)
    assert why == "the row is float32: attnkit-fp32 would be the attnkit peer again"


def test_masks_rows_in_a_tiny_run(tmp_path: Path) -> None:
    """The new workloads and the fp32 peer on small rows: every peer runs, attnkit-fp32
    computes the same attention as attnkit (in float32), and the record names the CPU flags."""
    rows = [
        ("document-equal", 256, "float32", "fwd"),
        ("gqa-window", 384, "float32", "fwd+bwd"),
        ("window", 384, "bfloat16", "fwd+bwd"),
        ("causal", 256, "bfloat16", "fwd"),
    ]
    result = bench.run(rows, peers=["sdpa", "attnkit", "attnkit-fp32"], reps=5, gemm=50.0)
    for row in result.rows:
        by_peer = {e.peer: e for e in row.entries}
        for name in ("sdpa", "attnkit"):
            assert by_peer[name].error is None, by_peer[name].error
            assert by_peer[name].ms is not None
            assert by_peer[name].peak_mib is not None
        fp32 = by_peer["attnkit-fp32"]
        if row.dtype == "float32":
            assert fp32.ms is None
            assert fp32.skipped is not None
            assert "the row is float32" in fp32.skipped
        else:
            assert fp32.error is None, fp32.error
            assert fp32.ms is not None
            assert fp32.x_best_peer is not None
    assert result.machine["cpu_features"] == cpu_features()
    assert result.machine["bf16_class"] == bf16_class(cpu_features())
    bench.write_json(result, tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["machine"]["cpu_features"] == cpu_features()
    md = bench.to_markdown(result)
    assert describe_features(cpu_features()) in md.splitlines()[0]
    # the peer computes what attnkit computes, on float32 copies of the inputs
    wl = WORKLOADS["window"]
    inputs = wl.inputs(384, torch.bfloat16)
    out = PEERS["attnkit-fp32"].setup(wl, inputs)()
    assert out.dtype == torch.float32
    q, k, v = (t.float() for t in (inputs.q, inputs.k, inputs.v))
    want = PEERS["attnkit"].setup(wl, Inputs(q, k, v, inputs.spec, inputs.causal))()
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_cpu_features_and_the_bf16_class() -> None:
    info = "processor\t: 0\nflags\t\t: fpu avx2 fma avx512f avx512_bf16 amx_tile amx_bf16\n"
    assert cpu_features(info) == ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert machine.cpu_line().startswith("CPU: ")
    assert describe_features(cpu_features()) in machine.cpu_line()
    assert bf16_class(cpu_features(info)) == "bf16"
    assert bf16_class(["avx2", "fma", "avx512f"]) == "no-bf16"  # AVX-512 without BF16
    assert bf16_class(["avx2", "fma"]) == "no-bf16"
    assert bf16_class(None) == "unknown"
    assert describe_features(["avx2", "fma"]) == (
        "avx2 fma (no avx512f, avx512_bf16, avx512_fp16, amx_tile, amx_bf16, amx_fp16)"
    )
    assert cpu_features("model name\t: some ARM\n") == []


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
        Row(
            "window",
            16384,
            "float32",
            "fwd+bwd",
            1.0,
            [_entry("sdpa", 500.0), _entry("attnkit", 100.0, peak_mib=2048.0)],
        ),
        Row("window", 65536, "float32", "fwd+bwd", 1.0, [_entry("attnkit", 900.0, peak_mib=9e4)]),
    ]
    result = BenchResult({}, 100.0, rows, 5)
    verdicts = {c.what: c.passed for c in acceptance(result)}
    assert verdicts["dense L=4096: auto time / SDPA time"] is True
    assert verdicts["causal L=4096: auto time / SDPA time"] is False
    assert verdicts["window 256, L=16384 fwd: SDPA (dense mask) / auto"] is True
    assert verdicts["window 256, L=16384 fwd: flex (warm) / auto"] is False  # 1.33x
    assert verdicts["window 256, L=16384 fwd: auto useful GFLOP/s / GEMM"] is True
    assert verdicts["8 documents, L=16384 fwd: SDPA (dense mask) / auto"] is None  # not run
    assert verdicts["window 256, L=16384 fwd+bwd: SDPA (dense mask) / auto"] is False  # 5x
    peak = "window 256, L=16384 fwd+bwd: auto peak memory above inputs (GiB)"
    assert verdicts[peak] is False  # 2 GiB
    assert verdicts["window 256, L=65536 fwd+bwd runs: auto peak memory above inputs (GiB)"]
    md = bench.to_markdown(result)
    assert (
        "| causal L=4096: auto time / SDPA time | causal L=4096 float32 fwd | 1.1 | <= 1.05 "
        "| **FAIL** |" in md
    )


def _masks_rows(window_bf16_ms: float, causal_bf16_ms: float) -> list[Row]:
    gemm = {"gemm_fraction": 0.7}
    return [
        Row(
            "causal", 4096, "float32", "fwd", 1.0, [_entry("sdpa", 120.0), _entry("attnkit", 100.0)]
        ),
        Row("document", 16384, "float32", "fwd", 1.0, [_entry("attnkit", 1.0, gemm_fraction=0.6)]),
        Row("document-equal", 16384, "float32", "fwd", 1.0, [_entry("attnkit", 1.0, **gemm)]),
        Row("gqa-window", 16384, "float32", "fwd+bwd", 1.0, [_entry("attnkit", 1.0, **gemm)]),
        Row(
            "window",
            4096,
            "bfloat16",
            "fwd",
            1.0,
            [_entry("attnkit", window_bf16_ms), _entry("attnkit-fp32", 100.0)],
        ),
        Row(
            "causal",
            4096,
            "bfloat16",
            "fwd",
            1.0,
            [
                _entry("sdpa", 150.0),
                _entry("attnkit", causal_bf16_ms),
                _entry("attnkit-fp32", 100.0),
            ],
        ),
    ]


def test_masks_acceptance_reads_the_rows_and_the_cpu_class() -> None:
    tag = "bf16 bars (CPU without bf16 instructions)"
    result = BenchResult(
        {"bf16_class": "no-bf16", "cpu_features": ["avx2", "fma"]},
        100.0,
        _masks_rows(window_bf16_ms=105.0, causal_bf16_ms=125.0),
        5,
    )
    verdicts = {c.what: c.passed for c in acceptance(result)}
    assert verdicts["masks: causal L=4096 fp32: SDPA is_causal / auto"] is True  # 1.2x
    assert verdicts["masks: 8 documents (uneven), L=16384 fwd: auto of GEMM"] is False
    assert verdicts["masks: 8 documents (equal), L=16384 fwd: auto of GEMM"] is True
    assert verdicts["masks: prefix-LM, L=4096 fwd: auto of GEMM"] is None  # not run
    fwd_bwd = "masks: grouped-query 32/8 window 256, L=16384 fwd+bwd: auto of GEMM"
    assert verdicts[fwd_bwd] is True
    assert verdicts[f"{tag}: window 256 bf16, L=4096 fwd: attnkit fp32 / bf16"] is True  # 0.95
    assert verdicts[f"{tag}: window 256 bf16, L=4096 fwd+bwd: attnkit fp32 / bf16"] is None
    assert verdicts[f"{tag}: causal bf16, L=4096 fwd: attnkit fp32 / bf16"] is False  # 0.8
    assert verdicts[f"{tag}: causal bf16, L=4096: SDPA bf16 / auto"] is True  # 1.2
    md = bench.to_markdown(result)
    assert "bfloat16 bars for a CPU without bf16 instructions (this one: avx2 fma" in md
    # the same times on a CPU with AVX512-BF16: bf16 has to beat fp32 by 1.5x there
    result.machine = {"bf16_class": "bf16", "cpu_features": ["avx2", "avx512f", "avx512_bf16"]}
    verdicts = {c.what: c.passed for c in acceptance(result)}
    tag = "bf16 bars (CPU with bf16 instructions)"
    assert verdicts[f"{tag}: window 256 bf16, L=4096 fwd: attnkit fp32 / bf16"] is False
    assert verdicts[f"{tag}: causal bf16, L=4096: SDPA bf16 / auto"] is False  # 1.2 < 1.5
    assert not any("without bf16" in what for what in verdicts)
    assert "for a CPU with AVX512-BF16 or AMX (this one: avx2 avx512f avx512_bf16" in (
        bench.to_markdown(result)
    )


def test_row_selection() -> None:
    default = bench.plan_rows()
    assert default == bench.DEFAULT_ROWS
    assert default[: len(bench.ACCEPTANCE_ROWS)] == bench.ACCEPTANCE_ROWS  # today's rows first
    assert set(default) == set(bench.ACCEPTANCE_ROWS) | set(bench.MASKS_ROWS)
    assert len(default) == len(set(default))  # the rows both groups name run once
    assert ("window", 16384, "float32", "fwd+bwd") in default
    assert bench.plan_rows(groups=["masks"]) == bench.MASKS_ROWS
    assert bench.plan_rows(groups=["acceptance"]) == bench.ACCEPTANCE_ROWS
    assert bench.plan_rows(groups=["masks", "acceptance"])[:10] == bench.MASKS_ROWS
    assert bench.plan_rows(groups=["masks"], dtypes=["bfloat16"], modes=["fwd+bwd"]) == [
        ("window", 4096, "bfloat16", "fwd+bwd")
    ]
    for workload, L, dtype, mode in bench.MASKS_ROWS:  # every row the masks group's bars name
        assert any(c[0] == (workload, L, dtype, mode) for c in criteria("no-bf16"))
    assert all(r[1] <= 2048 for r in bench.plan_rows(quick=True))
    picked = bench.plan_rows(workloads=["causal"], lengths=[1024], dtypes=["bfloat16"])
    assert picked == [("causal", 1024, "bfloat16", "fwd"), ("causal", 1024, "bfloat16", "fwd+bwd")]
    full = bench.plan_rows(full=True)
    assert len(full) == len(WORKLOADS) * 4 * 2 * 2


def test_a_group_name_that_is_not_one_is_one_line() -> None:
    """Only the groups' own names are taken (a retired name is refused like any other), on the
    command line in one line, exit 2, naming the groups there are; the library the same."""
    result = CliRunner().invoke(app, ["bench", "-g", "issue14", "--no-memory"])
    assert result.exit_code == 2, result.output
    assert "'issue14' is not one of acceptance, masks" in result.output
    assert "Traceback" not in result.output
    with pytest.raises(AttentionInputError, match="'issue14' is not one of acceptance, masks"):
        bench.plan_rows(groups=["issue14"])


def test_peers_say_why_they_skip() -> None:
    dense, window = WORKLOADS["dense"], WORKLOADS["window"]
    assert "GiB" in str(PEERS["naive"].skip(dense, 65536, torch.float32, False, 8 << 30))
    assert "dense mask" in str(PEERS["sdpa"].skip(window, 65536, torch.float32, False, 8 << 30))
    assert PEERS["sdpa"].skip(WORKLOADS["causal"], 65536, torch.float32, True, 8 << 30) is None
    assert "no backward" in str(PEERS["flex"].skip(window, 4096, torch.float32, True, 8 << 30))
    assert PEERS["torch-mha"].skip(dense, 64, torch.float32, False, 8 << 30) == "module rows only"
    assert PEERS["attnkit"].skip(window, 65536, torch.float32, True, 8 << 30) is None
    module = WORKLOADS["module"]
    for name in ("naive", "sdpa", "flex", "attnkit"):
        why = PEERS[name].skip(module, 64, torch.float32, False, 8 << 30)
        assert why == "module rows compare modules"
    x = module.inputs(16, torch.float32).x
    assert x is not None
    for name in ("torch-mha", "attnkit-mha"):
        assert PEERS[name].skip(module, 16, torch.float32, True, 8 << 30) is None
        out = PEERS[name].setup(module, module.inputs(16, torch.float32))()
        assert out.shape == x.shape  # (B, L, E)
    with pytest.raises(AttentionInputError, match="-p/--peer 'nonsense' is not one of naive, "):
        bench.run([("dense", 64, "float32", "fwd")], peers=["nonsense"])


def test_measure_gemm_and_lazy_imports() -> None:
    assert runner.measure_gemm(n=128, reps=5) > 0
    code = (
        "import sys, attnkit.cli, attnkit.bench; "
        "print('matplotlib' in sys.modules, 'torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# ---------------------------------------------------------------------------------------------
# bad options: one line, exit 2, before anything is measured


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any measurement fail the test: a refused option must stop the command before."""

    def ran(*args: object, **kwargs: object) -> None:
        raise AssertionError("the benchmark started")

    monkeypatch.setattr(bench, "run", ran)
    monkeypatch.setattr(runner, "machine", ran)
    monkeypatch.setattr(runner, "measure_gemm", ran)
    monkeypatch.setattr(runner, "_worker", ran)


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot write into (root writes everywhere but sysfs)."""
    if os.geteuid() == 0:
        return Path("/sys")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    return locked


BAD_OPTIONS: list[tuple[list[str], list[str]]] = [
    (["-w", "nonsense"], ["-w/--workload 'nonsense' is not one of dense, causal, padding"]),
    (["-L", "0"], ["-L/--length 0 is not a length", "it takes 1 to 262144", "(fix: pass lengths"]),
    (["-L", "10000000"], ["-L/--length 10000000 is not a length", "1 to 262144"]),
    (["-p", "nope"], ["-p/--peer 'nope' is not one of naive, sdpa, sdpa-sliced, flex, ort-gqa"]),
    (["--dtype", "float16"], ["--dtype 'float16' is not one of float32, bfloat16"]),
    (["--mode", "bwd"], ["--mode 'bwd' is not one of fwd, fwd+bwd"]),
    (["--reps", "3"], ["--reps must be at least 5", "got 3"]),
    (
        ["--gemm-size", "-1"],
        ["--gemm-size -1 is not a GEMM size: 0 (none) or an n from 1 to 16384"],
    ),
    (["--gemm-size", "100000"], ["--gemm-size 100000 is not a GEMM size"]),
    (["--cap-gib", "-1"], ["--cap-gib must be a positive number of GiB, got -1.0"]),
    (
        ["--min-call-ms", "-5"],
        ["--min-call-ms -5.0 is not a time per round: 0 (one call per round) or up to 10000 ms"],
    ),
    (["--min-call-ms", "inf"], ["--min-call-ms inf is not a time per round"]),
    (["--cap-gib", "nan"], ["--cap-gib must be a positive number of GiB, got nan"]),
    (["--quick", "--full"], ["--quick picks its own rows", "cannot go with --full"]),
    (["--quick", "-w", "window"], ["--quick picks its own rows", "cannot go with -w/--workload"]),
    (["--quick", "-L", "512"], ["cannot go with -L/--length", "(fix: leave out --quick, or"]),
    (["--quick", "--dtype", "bfloat16"], ["leave no rows to run: the quick rows are float32 fwd"]),
    (["-g", "nope"], ["-g/--group 'nope' is not one of acceptance, masks"]),
    (
        ["-g", "masks", "-w", "causal"],
        ["-g/--group picks the rows of its group", "-w/--workload"],
    ),
    (["--quick", "-g", "masks"], ["--quick picks its own rows", "cannot go with -g/--group"]),
    (["-g", "masks", "--full"], ["-g/--group picks the rows of its group", "with --full"]),
    (
        ["-g", "acceptance", "--dtype", "bfloat16", "--mode", "fwd+bwd"],
        ["leave no rows to run: the acceptance group rows are"],
    ),
    (["--json", "{tmp}/no/such/dir/x.json"], ["--json {tmp}/no/such/dir/x.json: the directory"]),
    (["--markdown", "{tmp}/missing/r.md"], ["{tmp}/missing does not exist", "mkdir -p"]),
    (["--plot", "{tmp}/missing/p.png"], ["--plot {tmp}/missing/p.png: the directory"]),
    (["--json", "{tmp}"], ["--json {tmp} is a directory"]),
    (["--json", "{file}/x.json"], ["--json {file}/x.json: {file} is not a directory"]),
    (["--plot", "{tmp}/p.svg"], ["the plot is a PNG, so its name must end in .png"]),
    (["--json", "{tmp}/a", "--markdown", "{tmp}/a"], ["--json and --markdown both name"]),
    (["--json", "{locked}/x.json"], ["--json {locked}/x.json cannot be written"]),
]


@pytest.mark.parametrize(("args", "parts"), BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
@pytest.mark.usefixtures("nothing_runs")
def test_bad_options_are_one_line_before_any_work(
    args: list[str], parts: list[str], tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("not a directory")
    where = {"tmp": str(tmp_path), "file": str(tmp_path / "file")}
    if any("{locked}" in a for a in args):
        where["locked"] = str(_unwritable_dir(tmp_path))
    before = sorted(tmp_path.rglob("*"))
    result = CliRunner().invoke(app, ["bench", *(a.format(**where) for a in args)])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("attnkit: error: ")
    assert " (fix: " in lines[0]
    for part in parts:
        assert part.format(**where) in lines[0], lines[0]
    assert sorted(tmp_path.rglob("*")) == before  # the probes left nothing behind


def test_the_library_refuses_the_same_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "machine", lambda: pytest.fail("the run started"))
    row = [("dense", 64, "float32", "fwd")]
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: bench.plan_rows(quick=True, workloads=["window"]), "cannot go with -w"),
        (lambda: bench.plan_rows(quick=True, full=True), "cannot go with --full"),
        (lambda: bench.plan_rows(lengths=[0]), "-L/--length 0 is not a length"),
        (lambda: bench.run([("nope", 64, "float32", "fwd")]), "-w/--workload 'nope'"),
        (lambda: bench.run([("dense", -5, "float32", "fwd")]), "-L/--length -5"),
        (lambda: bench.run(row, gemm_n=-1), "--gemm-size -1 is not a GEMM size"),
        (lambda: bench.run(row, cap_gib=0.0), "--cap-gib must be a positive number"),
        (lambda: bench.run(row, reps=0), "--reps must be a positive int"),
        (lambda: bench.run(row, min_call_ms=1e9), "--min-call-ms 1000000000.0 is not a time"),
    ]
    for call, message in cases:
        with pytest.raises(AttentionInputError, match=re.escape(message)):
            call()
    assert bench.plan_rows(quick=True, modes=["fwd+bwd"]) == [
        ("window", 2048, "float32", "fwd+bwd")
    ]  # --dtype and --mode filter the quick rows


def test_help_time_estimates_agree_with_the_docs() -> None:
    """The command's help says what docs/benchmarks.md measured: how long each run takes."""
    import typer.main

    docs = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    docs = " ".join(docs.split())
    command = typer.main.get_command(app).commands["bench"]  # type: ignore[attr-defined]
    options = {p.name: " ".join((getattr(p, "help", None) or "").split()) for p in command.params}
    default = re.search(r"(\d+(?: to \d+)? minutes) on this 2-core machine", docs)
    assert default is not None, "docs/benchmarks.md no longer says how long the default run takes"
    assert f"about {default.group(1)} on a quiet 2-core machine" in " ".join(command.help.split())
    assert "`--quick` is a one-minute smoke run" in docs
    assert options["quick"].startswith("a smoke run of about a minute")
    assert "with every peer (hours)" in docs
    assert options["full"].endswith("(hours)")


class _Sleeper:
    """A peer whose call sleeps a fixed time and counts its calls."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.count = seconds, 0

    def setup(self, wl: object, inputs: Inputs) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            self.count += 1
            time.sleep(self.seconds)
            return inputs.q

        return call


@pytest.mark.parametrize("min_call_ms", [20.0, 0.0])
def test_a_fast_call_is_repeated_within_its_round_and_the_round_takes_the_mean(
    monkeypatch: pytest.MonkeyPatch, min_call_ms: float
) -> None:
    fast, slow = _Sleeper(0.002), _Sleeper(0.03)
    monkeypatch.setitem(worker.PEERS, "fast", fast)
    monkeypatch.setitem(worker.PEERS, "slow", slow)
    job = {
        "kind": "time", "workload": "dense", "L": 16, "dtype": "float32", "backward": False,
        "peers": ["fast", "slow"], "reps": 3, "gemm_n": 0, "min_call_ms": min_call_ms,
    }  # fmt: skip
    got = worker.run_job(job)["peers"]
    assert got["slow"]["calls"] == 1  # 30 ms: one call a round
    calls = got["fast"]["calls"]
    if min_call_ms:
        assert 2 <= calls <= 10  # ceil(20 ms / the probe's time), a sleep of 2 ms or more
    else:
        assert calls == 1
    # the first call and the probe, untimed, then 3 rounds of `calls` each
    assert fast.count == 2 + 3 * calls
    assert slow.count == 2 + 3
    for name, peer in (("fast", fast), ("slow", slow)):
        times = got[name]["times"]
        assert len(times) == 3  # one time a round: the mean of its calls
        assert all(peer.seconds <= t < peer.seconds + 0.5 for t in times)


@pytest.mark.parametrize(
    ("value", "bar", "passed", "shown"),
    [
        (0.4996, ">= 0.5", False, "0.4996"),  # three digits would print the bar beside FAIL
        (0.50004, ">= 0.5", True, "0.50004"),
        (0.5, ">= 0.5", True, "0.5"),
        (0.766, ">= 0.65", True, "0.766"),
        (3.512, ">= 4x", False, "3.51"),
        (None, ">= 0.5", None, "-"),
    ],
)
def test_a_measured_value_is_never_printed_as_its_bar_when_it_differs(
    value: float | None, bar: str, passed: bool | None, shown: str
) -> None:
    from attnkit.bench.results import Check

    check = Check("criterion", "row", value, bar, passed)
    assert check.shown == shown
