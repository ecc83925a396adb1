"""Each question about a run is asked once: on ``--resume`` the ``--out`` directory is checked
once, the checkpoint's stored settings read once and the checkpoint verified once, whether the
run starts from the command line or from :func:`attnkit.train.train`."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import attnkit.train.checkpoint as checkpoint
import attnkit.train.guards as guards
from attnkit import AttentionInputError
from attnkit.cli import app
from attnkit.train import RunOptions, resume_config, train
from checkpoints import TINY_RUN as TINY
from checkpoints import copy_run

pytest.importorskip(
    "safetensors",
    reason="safetensors is not installed (the inspect extra: pip install '.[inspect]')",
)

runner = CliRunner()


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of TINY stopped after 2 of its 10 steps: a resume trains on."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    train(TINY, out, stop_at=2)
    return out


def _count(monkeypatch: pytest.MonkeyPatch, calls: Counter[str], func: Callable[..., Any]) -> None:
    """Count the calls of ``func`` wherever attnkit holds it (a module imported it by name, or
    calls it through its module)."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[func.__name__] += 1
        return func(*args, **kwargs)

    holders = [m for name, m in list(sys.modules.items()) if name.startswith("attnkit")]
    for module in holders:
        for attr, value in list(vars(module).items()):
            if value is func:
                monkeypatch.setattr(module, attr, counted)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    import attnkit.cli.train  # noqa: F401  (so that what it holds is counted too)

    counter: Counter[str] = Counter()
    for func in (guards.check_out, checkpoint.read_info, checkpoint.verify_checkpoint):
        _count(monkeypatch, counter, func)
    return counter


ONCE = {"check_out": 1, "read_info": 1, "verify_checkpoint": 1}


def test_the_command_line_checks_a_resumed_run_once(
    stopped: Path, tmp_path: Path, calls: Counter[str]
) -> None:
    out = copy_run(stopped, tmp_path)
    result = runner.invoke(app, ["train", "--resume", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "trained 10 steps (resumed at step 2)" in result.stdout
    assert dict(calls) == ONCE


def test_the_command_line_checks_a_new_run_once(
    stopped: Path, tmp_path: Path, calls: Counter[str]
) -> None:
    out = copy_run(stopped, tmp_path)  # --overwrite: a new run over the stopped one
    result = runner.invoke(app, ["train", "--overwrite", "--steps", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "trained 2 steps in " in result.stdout
    assert dict(calls) == {"check_out": 1}  # nothing of the old run is read


def test_train_checks_a_resumed_run_once(
    stopped: Path, tmp_path: Path, calls: Counter[str]
) -> None:
    out = copy_run(stopped, tmp_path)
    result = train(TINY.resolved(), out, resume=True)
    assert (result.fit.start_step, result.fit.step) == (2, 10)
    assert dict(calls) == ONCE


def test_a_checked_run_is_not_checked_again(
    stopped: Path, tmp_path: Path, calls: Counter[str]
) -> None:
    out = copy_run(stopped, tmp_path)
    options = RunOptions(resume=True, stop_at=4)
    checked = options.prepare(TINY, out)
    assert dict(calls) == ONCE
    result = train(TINY, out, resume=True, stop_at=4, checked=checked)
    assert (result.fit.start_step, result.fit.step, result.fit.stopped) == (2, 4, True)
    assert dict(calls) == ONCE  # train() took the checks as done


def test_a_run_checked_for_other_arguments_is_refused(stopped: Path, tmp_path: Path) -> None:
    out = copy_run(stopped, tmp_path)
    checked = RunOptions(resume=True).prepare(resume_config(out), out)
    before = (out / "checkpoint.safetensors").read_bytes()
    for kwargs in ({"stop_at": 4}, {"resume": False, "overwrite": True}):
        with pytest.raises(AttentionInputError) as e:
            train(TINY, out, checked=checked, **{"resume": True, **kwargs})
        assert e.value.argument == "checked"
        assert "was checked for another run" in e.value.problem
    with pytest.raises(AttentionInputError) as e:
        train(TINY, tmp_path / "elsewhere", resume=True, checked=checked)
    assert e.value.argument == "checked"
    assert str(out) in e.value.problem
    assert (out / "checkpoint.safetensors").read_bytes() == before
