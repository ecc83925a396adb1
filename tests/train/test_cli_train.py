"""``attnkit train`` from the command line: a short real run, --resume, and every error path
(one line on stderr, ``attnkit: error: ...``, exit code 2, before any work), --overwrite, and
a run that diverges (one line, exit code 1, the last good checkpoint kept)."""

from __future__ import annotations

import inspect
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

import attnkit.cli.train as cli_train
import attnkit.train
import attnkit.train.loop as loop
from attnkit.cli import app
from attnkit.train import CHECKPOINT_NAME, TrainConfig
from checkpoints import edit_checkpoint

load_file = pytest.importorskip(
    "safetensors.torch",
    reason="safetensors is not installed (the inspect extra: pip install '.[inspect]')",
).load_file

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
    """Exit 2, one line on stderr, no traceback, and nothing on stdout: refused before any work
    (not even the header)."""
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
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


# ---------------------------------------------------------------------------------------------
# never losing a run


def _copy(run: Path, tmp_path: Path) -> Path:
    """A copy of the short run's directory, to damage without touching the shared one."""
    return Path(shutil.copytree(run, tmp_path / "copy"))


def test_a_second_run_in_the_same_out_is_refused(short_run: tuple[Result, Path]) -> None:
    _, out = short_run
    before = (out / CHECKPOINT_NAME).read_bytes()
    line = _one_line_error(["--steps", "10", "--out", str(out)])
    assert line == (
        f"attnkit: error: --out {out} already holds a run's checkpoint (step 10, finished); a "
        "new run would overwrite it. (fix: pass --resume to continue that run, or --overwrite "
        "to start a new run over it)"
    )
    line = _one_line_error(["--resume", "--overwrite", "--out", str(out)])
    assert "--resume continues the run in --out and --overwrite replaces it" in line
    assert (out / CHECKPOINT_NAME).read_bytes() == before


class _ReachedError(Exception):
    """Raised by a stand-in for attnkit.train.train: the command got past its checks."""


def test_overwrite_starts_a_new_run_over_the_old_one(
    short_run: tuple[Result, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, out = short_run
    asked: dict[str, Any] = {}

    def reached(config: TrainConfig, where: Path, **kwargs: Any) -> None:
        asked.update(kwargs, config=config, out=where)
        raise _ReachedError

    monkeypatch.setattr(attnkit.train, "train", reached)
    result = runner.invoke(app, ["train", "--overwrite", "--seed", "3", "--out", str(out)])
    assert isinstance(result.exception, _ReachedError), result.output
    assert asked["overwrite"] is True
    assert asked["resume"] is False
    assert asked["config"].seed == 3
    assert asked["out"] == out
    assert result.stderr.splitlines() == [
        f"attnkit: note: --overwrite: this new run's first checkpoint replaces the one in {out}"
    ]


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot write into (root writes everywhere but sysfs)."""
    if os.geteuid() == 0:
        return Path("/sys")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    return locked


def test_an_unusable_out_or_too_many_processes_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    afile = tmp_path / "file"
    afile.write_text("a file")
    locked = _unwritable_dir(tmp_path)
    line = _one_line_error(["--out", ""])
    assert line == "attnkit: error: --out is empty. (fix: pass --out DIR (default: attnkit-train))"
    line = _one_line_error(["--out", str(afile)])
    assert line.startswith(f"attnkit: error: --out {afile} is a file, not a directory.")
    line = _one_line_error(["--out", str(afile / "run")])
    assert f"--out {afile}/run cannot be created: {afile} is a file." in line
    line = _one_line_error(["--out", str(locked / "run")])
    assert f"--out {locked}/run cannot be written: {locked}: " in line
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    line = _one_line_error(["--ddp", "128", "--out", str(tmp_path / "run")])
    assert line == (
        "attnkit: error: --ddp 128 is more processes than this machine runs at once: at most 8 "
        "(one per CPU core, os.cpu_count() = 8). (fix: pass --ddp 8 or fewer)"
    )
    assert {p.name for p in tmp_path.iterdir()} <= {"file", "locked"}  # no run directory


def test_resume_refuses_a_checkpoint_with_a_nan_naming_the_tensor(
    short_run: tuple[Result, Path], tmp_path: Path
) -> None:
    copy = _copy(short_run[1], tmp_path)
    path = copy / CHECKPOINT_NAME
    name = sorted(k for k in load_file(str(path)) if k.startswith("model."))[0]
    edit_checkpoint(path, nan_in=name)
    damaged = path.read_bytes()
    line = _one_line_error(["--resume", "--out", str(copy)])
    assert f"tensor {name} (" in line
    assert "holds 1 NaN and 0 inf of its" in line
    assert line.endswith("(fix: resume from an intact copy, or start a new run with --overwrite)")
    assert path.read_bytes() == damaged


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"step": "ten"}, "its metadata field 'step' is 'ten', not a number of steps"),
        ({"config": "{"}, "its metadata field 'config' is '{', not a JSON object of settings"),
        ({"config": '{"steps": 10, "bogus": 1}'}, "its stored settings are not a valid run"),
    ],
)
def test_resume_refuses_edited_metadata_in_one_line(
    edit: dict[str, str], message: str, short_run: tuple[Result, Path], tmp_path: Path
) -> None:
    copy = _copy(short_run[1], tmp_path)
    edit_checkpoint(copy / CHECKPOINT_NAME, **edit)
    line = _one_line_error(["--resume", "--out", str(copy)])
    assert message in line
    assert "the file was edited or damaged" in line


def test_a_non_finite_loss_stops_the_run_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loop, "lr_at", lambda config, step: 1e6)  # diverges at once
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "--steps", "50", "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.stdout.startswith("attnkit train: reverse")  # it had started
    (line,) = result.stderr.splitlines()
    assert line.startswith("attnkit: error: training stopped at step ")
    assert " of 50: the training loss is nan; nothing of that step was saved, " in line
    assert line.endswith("A lower learning rate or another --seed usually avoids it.")
    assert not (out / CHECKPOINT_NAME).exists()
