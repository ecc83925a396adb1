"""``attnkit train`` from the command line: a short real run, --resume, and every error path
(one line on stderr, ``attnkit: error: ...``, exit code 2)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

import attnkit.cli.train as cli_train
from attnkit.cli import app
from attnkit.train import TrainConfig

runner = CliRunner()


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path]:
    out = tmp_path_factory.mktemp("cli") / "run"
    return runner.invoke(app, ["train", "--steps", "10", "--out", str(out)]), out


def test_train_runs_end_to_end(short_run: tuple[Result, Path]) -> None:
    result, out = short_run
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "attnkit train: reverse (reverse a sequence of letters), T=16, vocab 16"
    assert "1 process, 1 torch thread, cpu" in lines[2]
    assert lines[4].startswith("trained 10 steps in ")
    assert lines[5].startswith("held-out test: ")
    assert "of 10000 sequences fully right" in lines[5]
    assert lines[6] == "one held-out sequence:"
    assert lines[7].startswith("  input ")
    assert lines[8].startswith("  target ")
    assert lines[10].startswith("attention: layer ")
    assert "on the mirrored position T-1-i in" in lines[10]
    assert lines[11].startswith("           layer ")
    assert ", its heads averaged: " in lines[11]
    assert lines[12] == "wrote:"
    names = [Path(line.split()[0]).name for line in lines[13:17]]
    assert names == ["checkpoint.safetensors", "attention.html", "attention.png", "attention.npz"]
    assert all((out / name).is_file() for name in names)
    summary = lines[-1]
    assert summary.startswith("attnkit train: reverse ")
    assert "held-out sequence accuracy" in summary
    assert " in 10 steps, " in summary
    assert summary.endswith(" s in all")
    # without a terminal the progress is one line per evaluation on stderr
    progress = result.stderr.splitlines()
    assert [line.split()[2] for line in progress] == ["10/10"]
    assert all(line.startswith("attnkit: step ") and " loss " in line for line in progress)


def test_resume_of_a_finished_run_trains_nothing(short_run: tuple[Result, Path]) -> None:
    _, out = short_run
    result = runner.invoke(app, ["train", "--resume", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "the run was already finished at step 10: nothing to train" in result.stdout
    assert "at most 10 steps" in result.stdout.splitlines()[2]  # the checkpoint's settings


def _one_line_error(args: list[str]) -> str:
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("attnkit: error: ")
    assert "Traceback" not in result.output
    return lines[0]


def test_errors_are_one_line(short_run: tuple[Result, Path], tmp_path: Path) -> None:
    _, out = short_run
    line = _one_line_error(["--task", "nope", "--out", str(tmp_path)])
    assert line == (
        "attnkit: error: unknown task 'nope'. (fix: pick one of reverse, sort, kv_recall)"
    )
    assert "--steps must be a positive int, got 0" in _one_line_error(["--steps", "0"])
    line = _one_line_error(["--ddp", "3", "--out", str(tmp_path)])
    assert "--ddp 3 does not divide the batch of 128" in line
    assert "(fix: use --ddp 2" in line
    assert "unknown device 'gpu0'" in _one_line_error(["--device", "gpu0", "--out", str(tmp_path)])
    line = _one_line_error(["--resume", "--out", str(tmp_path / "empty")])
    assert "there is no checkpoint at" in line
    assert "run without --resume first" in line
    line = _one_line_error(["--resume", "--steps", "40", "--out", str(out)])
    assert "has steps=10, but steps=40 was asked for" in line
    assert "(fix: leave out --steps, or start a new run without --resume)" in line
    assert not list(tmp_path.iterdir())  # nothing was written by the refused calls


def test_command_defaults_are_the_config_defaults() -> None:
    defaults = {
        name: p.default
        for name, p in inspect.signature(cli_train.train).parameters.items()
        if name in ("task", "steps", "seed")
    }
    config = TrainConfig()
    assert defaults == {"task": config.task, "steps": config.steps, "seed": config.seed}
