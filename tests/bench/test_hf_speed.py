"""benchmarks/hf_speed.py (the Hugging Face speed program) on tiny lengths: it runs both
implementations on the same model, prints the table with every row and verdict, writes its JSON
and its markdown between the markers, and refuses a markdown file it would clobber.

No timing is asserted: the numbers are only checked to exist and be consistent.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from attnkit.backends import available_backends
from attnkit.bench.machine import cpu_features, describe_features

pytest.importorskip("transformers", reason="hf_speed.py needs the hf extra (transformers)")

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "benchmarks" / "hf_speed.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run(
        [sys.executable, str(PROGRAM), *args], capture_output=True, text=True, env=env, check=False
    )


def test_a_tiny_run_prints_the_table_and_both_models_agree(tmp_path: Path) -> None:
    doc = tmp_path / "hf.md"
    doc.write_text("# prose\n<!-- hf_speed: start -->\nold\n<!-- hf_speed: end -->\ntail\n")
    out = _run(
        "--quick", "--length", "300", "--train-length", "280", "--reps", "2",
        "--json", str(tmp_path / "r.json"), "--markdown", str(doc),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("**Machine:** ")
    assert describe_features(cpu_features()) in lines[0]  # the CPU's flags are recorded
    assert "transformers " in lines[0]
    rows = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| case")]
    assert [r.split(" | ")[0] for r in rows] == [
        "| forward, L=300 (no_grad): median ms",
        "| training step, L=280 (forward + backward, loss on logits): median ms",
        "| forward, L=300 (no_grad): peak MiB above model and inputs",
        "| training step, L=280 (forward + backward, loss on logits): peak MiB above model and "
        "inputs",
    ]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 6
        assert cells[4] in (">= 4x", "attnkit lower")
        assert cells[5] in ("PASS", "FAIL")  # both measured, so a verdict either way
    assert "are not the issue's 8192 / 4096: these verdicts do not judge it" in out.stdout

    result = json.loads((tmp_path / "r.json").read_text())
    assert result["lengths"] == {"fwd": 300, "train": 280}
    assert result["model"]["num_attention_heads"] == 8
    assert result["model"]["num_key_value_heads"] == 2
    for step in ("fwd", "train"):
        times = result["times_ms"][step]
        assert sorted(times) == ["attnkit", "sdpa"]
        assert all(len(t) == 2 for t in times.values())
        assert result["median_ms"][step]["sdpa"] == statistics.median(times["sdpa"])
        backends = result["checks"][step]["attnkit_backends"]
        assert len(backends) == 2  # attnkit served both layers
        assert set(backends) <= set(available_backends())
        paths = result["attnkit_path"][step]
        assert [p.split(":")[0] for p in paths] == backends  # explain agrees with the trace
        for impl in ("sdpa", "attnkit"):
            assert result["peak_mib"][step][impl]["peak_mib"] > 0
    # the same weights: attnkit and sdpa compute the same model
    assert result["checks"]["fwd"]["logits_max_abs_diff"] <= 1e-4
    assert result["checks"]["train"]["loss_abs_diff"] <= 1e-5
    assert result["checks"]["train"]["grad_max_abs_diff"] <= 1e-4
    assert result["machine"]["cpu_features"] is not None
    for step in ("fwd", "train"):  # time inside the attention functions: part of each call
        for impl in ("attnkit", "sdpa"):
            inside = result["attention_ms"][step][impl]
            assert 0 < inside < max(result["times_ms"][step][impl])
    assert "Inside the attention functions during the forward (medians, ms;" in out.stdout
    for step, name in (("fwd", "forward, L=300"), ("train", "training step, L=280")):
        # the ceiling: the model without attention, timed in the same rounds; no faster than
        # its attention-free part
        base, sdpa = result["no_attention_ms"][step], result["median_ms"][step]["sdpa"]
        assert base > 0
        line = next(ln for ln in lines if ln.startswith(f"- {name}") and "without attention" in ln)
        assert f"{base:,.1f} ms without attention" in line
        assert f"more than {sdpa / base:.2f}x faster than sdpa's {sdpa:,.1f} ms" in line

    text = doc.read_text()
    assert text.startswith("# prose\n<!-- hf_speed: start -->\n**Machine:** ")
    assert text.endswith("<!-- hf_speed: end -->\ntail\n")
    assert "old" not in text
    assert "| forward, L=300 (no_grad): median ms |" in text


def test_the_attention_free_reference_passes_values_through() -> None:
    """The ceiling's model: query i gets value i, repeated over the query heads of its group."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import hf_speed
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    import torch

    q, v = torch.randn(2, 8, 5, 4), torch.randn(2, 2, 5, 4)
    out, weights = hf_speed.no_attention(None, q, v, v, None)
    assert weights is None
    assert out.shape == (2, 5, 8, 4)  # (B, L, H, D), as transformers expects
    assert torch.equal(out[:, :, 3], v[:, 0])
    assert torch.equal(out[:, :, 4], v[:, 1])


def test_the_ceiling_gives_a_ratio_only_where_attnkits_share_is_above_the_noise() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import hf_speed
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    names = {"forward": "forward, L=8: median ms"}
    result = {"no_attention_ms": {"forward": 1000.0}}
    result["median_ms"] = {"forward": {"attnkit": 981.5, "sdpa": 3000.0}}  # below the ceiling
    (line,) = [x for x in hf_speed._ceiling(result, names) if x.startswith("- forward")]
    assert (
        "attention adds -18.5 ms on attnkit, 2,000.0 ms on sdpa (attnkit's within noise)." in line
    )
    result["median_ms"] = {"forward": {"attnkit": 1100.0, "sdpa": 3000.0}}
    (line,) = [x for x in hf_speed._ceiling(result, names) if x.startswith("- forward")]
    assert "attention adds 100.0 ms on attnkit, 2,000.0 ms on sdpa (20.0x)." in line
    assert "more than 3.00x faster than sdpa's 3,000.0 ms" in line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--length", "1"], "argument --length: 1 is not a length from 2 to 131072"),
        (["--reps", "0"], "argument --reps: 0 is not >= 1"),
        (["--intermediate", "0"], "argument --intermediate: 0 is not >= 1"),
        (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
        (["--json", "/no/such/dir/r.json"], "--json /no/such/dir/r.json: the directory"),
        (["--markdown", "{plain}"], "the file exists without the markers <!-- hf_speed: start"),
    ],
)
def test_bad_options_stop_before_any_work(tmp_path: Path, args: list[str], message: str) -> None:
    plain = tmp_path / "plain.md"
    plain.write_text("# a page without the markers\n")
    out = _run(*(a.format(plain=plain) for a in args))
    assert out.returncode == 2
    assert out.stdout == ""
    assert message in out.stderr.splitlines()[-1]
    assert plain.read_text() == "# a page without the markers\n"


def test_a_bfloat16_run_says_its_model_and_writes_between_its_own_markers(tmp_path: Path) -> None:
    """Short lengths: on a CPU without bf16 instructions torch's bfloat16 matmuls crawl."""
    doc = tmp_path / "hf.md"
    f32 = "<!-- hf_speed: start -->\nthe float32 record\n<!-- hf_speed: end -->\n"
    tag = "hf_speed bfloat16 intermediate 64"  # the markers of this dtype and MLP width
    bf16 = f"<!-- {tag}: start -->\nold\n<!-- {tag}: end -->\n"
    doc.write_text(f32 + bf16)
    out = _run(
        "--dtype", "bfloat16", "--length", "40", "--train-length", "32", "--reps", "1",
        "--no-memory", "--json", str(tmp_path / "r.json"), "--markdown", str(doc),
        "--intermediate", "64",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "intermediate 64, vocabulary 1024, bfloat16, B=1, random weights" in out.stdout
    assert "The MLP is 64 wide, not Mistral's 3.5 x hidden (1792) recorded for the issue" in (
        out.stdout
    )
    assert "The model is bfloat16, not the issue's float32: these verdicts do not judge it." in (
        out.stdout
    )
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["model"]["dtype"] == "bfloat16"
    assert result["model"]["intermediate_size"] == 64
    # both models compute the same bfloat16 model: they differ by bf16 rounding only
    assert result["checks"]["fwd"]["logits_max_abs_diff"] <= 0.1
    assert result["checks"]["train"]["grad_max_abs_diff"] <= 0.1
    assert "(training step): within 0.1." in out.stdout
    text = doc.read_text()
    assert text.startswith(f32)  # the float32 record stays
    assert "old" not in text
    assert f"\n<!-- {tag}: start -->\n**Machine:** " in text
    assert text.endswith(f"<!-- {tag}: end -->\n")


def test_a_markdown_file_without_the_dtypes_markers_is_refused(tmp_path: Path) -> None:
    doc = tmp_path / "hf.md"
    doc.write_text("<!-- hf_speed: start -->\nthe float32 record\n<!-- hf_speed: end -->\n")
    out = _run("--dtype", "bfloat16", "--no-memory", "--markdown", str(doc))
    assert out.returncode == 2
    assert "the file exists without the markers <!-- hf_speed bfloat16: start -->" in out.stderr
    assert doc.read_text().endswith("the float32 record\n<!-- hf_speed: end -->\n")
