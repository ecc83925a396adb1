"""The ``attnkit`` command line: ``demo``, ``version``, ``--help`` (flags shown without a type),
and ``python -m attnkit``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
import typer.main
from typer.testing import CliRunner

import attnkit
from attnkit.cli import app

runner = CliRunner()

WEIGHTS_LINE = (
    'weights of the 2nd word "is" over the sentence: '
    "[0.2912, 0.0106, 0.0982, 0.0625, 0.4917, 0.0458]"
)


def _check_demo_output(text: str) -> None:
    assert WEIGHTS_LINE in text
    assert "its context vector starts [-1.5993, 0.0156, 1.2670, 0.0032, ...]" in text
    assert "(L, E)          (6, 16)" in text
    assert "(B, H, L, Dk)   (1, 1, 6, 24)" in text
    assert "(B, Hkv, S, Dv) (1, 1, 6, 28)" in text
    assert "(B, H, L, S)    (1, 1, 6, 6)" in text
    assert "(B, H, L, Dv)   (1, 1, 6, 28)" in text
    assert "equal to the above: True" in text
    assert "(B, L, H*Dv) (1, 6, 84)" in text
    assert "(B, L, E) (1, 6, 16)" in text


def test_demo(tmp_path: Path) -> None:
    result = runner.invoke(app, ["demo", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    _check_demo_output(result.output)
    assert result.output.splitlines()[0].startswith('sentence: "Life is short, eat dessert first"')


def test_help_lists_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0, result.output
    assert "demo" in result.output
    assert "version" in result.output
    assert "Self-attention for PyTorch" in result.output


def test_no_arguments_shows_help() -> None:
    result = runner.invoke(app, [])
    assert "demo" in result.output
    assert "Usage" in result.output


def test_version() -> None:
    result = runner.invoke(app, ["version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"attnkit {attnkit.__version__}, torch {torch.__version__}"


def test_unknown_command_fails() -> None:
    result = runner.invoke(app, ["no-such-command"])
    assert result.exit_code != 0


def test_python_dash_m_attnkit_demo(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "attnkit", "demo", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    _check_demo_output(proc.stdout)


def test_help_shows_no_type_for_flags() -> None:
    """Flags take no value: typer's ``<bool>`` in the type column is gone, the flags remain."""
    commands = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    wide = {"COLUMNS": "160", "TERMINAL_WIDTH": "160"}
    for args in [["--help"]] + [[name, "--help"] for name in commands]:
        result = runner.invoke(app, args, env=wide)
        assert result.exit_code == 0, result.output
        assert "<bool>" not in result.output, (args, result.output)
        assert "--help " in result.output
    bench = runner.invoke(app, ["bench", "--help"], env=wide).output
    assert "<int>" in bench  # options that take a value keep their type
    for flag in ("--quick", "--full", "--memory", "--no-memory"):
        assert flag in bench
    train = runner.invoke(app, ["train", "--help"], env=wide).output
    assert "--resume" in train
    assert "--overwrite" in train


def test_trace_refuses_sizes_it_cannot_hold_in_one_line() -> None:
    """``trace`` prints shapes, which do not depend on the sizes: beyond 2 GiB it refuses, before
    building anything."""
    for args, size in [
        (["--seq", "100000"], "would take about 1,194.8 GiB"),
        (["--seq", "6", "--cross-len", "10000000"], "would take about 121.6 GiB"),
        (["--d-model", "1000000", "--heads", "8"], "would take about 14,901.5 GiB"),
    ]:
        result = runner.invoke(app, ["trace", *args])
        assert result.exit_code == 2, result.output
        assert result.stdout == ""
        (line,) = result.stderr.splitlines()
        assert line.startswith("attnkit: error: --batch 2 --seq ")
        assert size in line
        assert "more than the 2 GiB a trace may use" in line
        assert "(fix: trace smaller sizes: the steps and their named shapes are the same" in line
    assert runner.invoke(app, ["trace", "--seq", "64"]).exit_code == 0  # small sizes still run
