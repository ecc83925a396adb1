"""The bench's outputs against hostile paths: a link planted at ``--json``, ``--markdown`` or
``--plot`` (and at the CUDA bench's and benchmarks/hf_speed.py's files) is replaced, its target
neither written nor read; the option check never opens the path; a full disk is one line and
exit 2, the previous file intact. Nothing is measured: the runs are stand-ins."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from attnkit import AttentionInputError, bench
from attnkit.bench import cuda
from attnkit.bench.results import BenchResult, Entry, Row
from attnkit.cli import app
from attnkit.cli import bench as bench_command
from attnkit.cli.app import check_output_file

ROOT = Path(__file__).resolve().parents[2]
START, END = "<!-- attnkit bench: start -->", "<!-- attnkit bench: end -->"
SECRET = "the user's private notes"


def _result() -> BenchResult:
    rows = [
        Row(
            "causal",
            256,
            "float32",
            "fwd",
            1.0,
            [Entry("sdpa", ms=2.0, x_best_peer=1.0), Entry("attnkit", ms=1.0, x_best_peer=0.5)],
        )
    ]
    return BenchResult({}, 100.0, rows, 5)


def _victim(tmp_path: Path, name: str, text: str = SECRET) -> Path:
    victim = tmp_path / f"victim-{name}"
    victim.write_text(text)
    return victim


@pytest.mark.parametrize(
    ("name", "write"),
    [
        ("r.json", bench.write_json),
        ("r.md", bench.write_markdown),
        ("r.png", bench.write_plot),
    ],
)
def test_each_bench_writer_replaces_a_planted_link(
    name: str, write: object, tmp_path: Path
) -> None:
    # the victim even holds the markers: a link's target is never read into the report
    victim = _victim(tmp_path, name, f"{SECRET}\n{START}\nold\n{END}\n")
    link = tmp_path / name
    link.symlink_to(victim)
    write(_result(), link)  # type: ignore[operator]
    assert victim.read_text() == f"{SECRET}\n{START}\nold\n{END}\n"
    assert not link.is_symlink()
    assert SECRET.encode() not in link.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, victim.name])


def test_the_option_check_never_opens_the_path(tmp_path: Path) -> None:
    dangling = tmp_path / "r.json"
    dangling.symlink_to(tmp_path / "created-through-the-link")
    check_output_file("attnkit bench", "--json", dangling)
    assert not (tmp_path / "created-through-the-link").exists()  # open(path, "a") made it
    assert dangling.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # the probe removed too


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """``attnkit bench`` measures nothing: its run returns a ready result."""
    monkeypatch.setattr(bench, "run", lambda *a, **k: _result())


def _bench(tmp_path: Path, *extra: str) -> Result:
    args = ["bench", "-w", "causal", "-L", "256", "--dtype", "float32", "--mode", "fwd"]
    return CliRunner().invoke(app, [*args, "-p", "sdpa", "-p", "attnkit", *extra])


@pytest.mark.usefixtures("stand_in")
def test_the_cli_replaces_planted_links_at_each_output(tmp_path: Path) -> None:
    names = {"--json": "r.json", "--markdown": "r.md", "--plot": "r.png"}
    victims = {}
    for name in names.values():
        victims[name] = _victim(tmp_path, name)
        (tmp_path / name).symlink_to(victims[name])
    paths = [x for flag, name in names.items() for x in (flag, str(tmp_path / name))]
    result = _bench(tmp_path, *paths)
    assert result.exit_code == 0, result.output
    for name, victim in victims.items():
        assert victim.read_text() == SECRET
        assert not (tmp_path / name).is_symlink()
    assert json.loads((tmp_path / "r.json").read_text())["reps"] == 5


def _full(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.usefixtures("stand_in")
@pytest.mark.parametrize("flag", ["--json", "--markdown", "--plot"])
def test_a_full_disk_is_one_line_exit_2_and_keeps_the_previous_file(
    flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / {"--json": "r.json", "--markdown": "r.md", "--plot": "r.png"}[flag]
    path.write_text("the previous report")
    if flag == "--plot":
        from matplotlib.figure import Figure

        monkeypatch.setattr(Figure, "savefig", _full)
    else:
        monkeypatch.setattr(os, "write", _full)
    result = _bench(tmp_path, flag, str(path))
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert lines == [
        f"attnkit: error: no space left on device while writing {path}; the previous "
        f"{path.name} is intact. (fix: free some space on that disk, or write somewhere else)"
    ]
    assert path.read_text() == "the previous report"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_the_cuda_bench_files_replace_planted_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = BenchResult({"device": "cuda", "torch": "2", "cuda": None}, 1e5, [], 5, device="cuda")
    monkeypatch.setattr(cuda, "require_cuda", lambda: None)
    monkeypatch.setattr(cuda, "run_cuda", lambda *a, **k: result)
    victims = {name: _victim(tmp_path, name) for name in ("c.json", "c.md")}
    for name, victim in victims.items():
        (tmp_path / name).symlink_to(victim)
    bench_command.bench(
        device="cuda", cap_gib=1.0, json_out=tmp_path / "c.json", markdown=tmp_path / "c.md"
    )
    for name, victim in victims.items():
        assert victim.read_text() == SECRET
        assert not (tmp_path / name).is_symlink()
    assert json.loads((tmp_path / "c.json").read_text())["device"] == "cuda"
    monkeypatch.setattr(os, "write", _full)
    with pytest.raises(AttentionInputError, match="no space left on device") as e:
        bench_command.bench(device="cuda", cap_gib=1.0, json_out=tmp_path / "c.json")
    assert e.value.argument == "--json"
    assert e.value.where == "attnkit bench --device cuda"


def test_hf_speed_markdown_never_reads_or_writes_through_a_link(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import hf_speed
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    start, end = hf_speed.markers("float32", hf_speed.BAR_INTERMEDIATE)
    victim = _victim(tmp_path, "hf.md", f"{SECRET}\n{start}\nold\n{end}\n")
    link = tmp_path / "hf.md"
    link.symlink_to(victim)
    hf_speed.write_markdown("the table\n", link)
    assert victim.read_text() == f"{SECRET}\n{start}\nold\n{end}\n"
    assert link.read_text() == "the table\n"
