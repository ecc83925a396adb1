"""A full disk while saving: the save fails with ``ENOSPC`` (monkeypatched where the bytes are
written, and for real on a 256 KiB tmpfs), the run ends with one line and exit code 2, and the
previous checkpoint is intact, with no temporary file left behind."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from attnkit.cli import app
from attnkit.files import WriteError
from attnkit.train import (
    CHECKPOINT_NAME,
    build,
    load_checkpoint,
    save_checkpoint,
    train,
    verify_checkpoint,
)
from attnkit.train.checkpoint import read_info
from checkpoints import TINY_RUN as TINY
from checkpoints import copy_run as _copy
from checkpoints import one_line_error as _one_line_error

_st = pytest.importorskip(
    "safetensors",
    reason="safetensors is not installed (the inspect extra: pip install '.[inspect]')",
)
import safetensors.torch  # noqa: E402

runner = CliRunner()


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 2 of TINY's 10 steps, stopped there: its directory holds only the checkpoint."""
    out = tmp_path_factory.mktemp("made") / "run"
    train(TINY, out, stop_at=2)
    return out


def _full(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _rust_full(*args: object, **kwargs: object) -> None:  # what safetensors raises for real
    raise _st.SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    )


@pytest.mark.parametrize("fail", [_full, _rust_full], ids=["OSError", "SafetensorError"])
def test_a_full_disk_while_saving_keeps_the_previous_checkpoint(
    fail: object, made: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _copy(made, tmp_path)
    path = out / CHECKPOINT_NAME
    before = path.read_bytes()
    _, model, opt = build(TINY.resolved())
    load_checkpoint(path, model, opt)
    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    with pytest.raises(WriteError) as e:
        save_checkpoint(path, model, opt, step=3, finished=False, config={})
    assert e.value.problem == (
        f"no space left on device while writing {path}; the previous checkpoint is intact."
    )
    assert e.value.errno == errno.ENOSPC
    assert path.read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == [CHECKPOINT_NAME]  # no temporary file


def test_a_full_disk_during_a_run_stops_it_in_one_line_exit_2(
    made: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _copy(made, tmp_path)
    path = out / CHECKPOINT_NAME
    saves = []
    real = safetensors.torch.save_file

    def second_fails(*args: Any, **kwargs: Any) -> None:  # step 4's save works, step 6's not
        saves.append(1)
        if len(saves) > 1:
            _full()
        real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", second_fails)
    with pytest.raises(WriteError) as e:
        train(TINY, out, resume=True)
    assert "no space left on device while writing" in e.value.problem
    assert (e.value.where, e.value.argument) == ("attnkit train", "out")
    assert e.value.fix == (
        f"free some space on that disk, then continue with: attnkit train --resume --out {out}"
    )
    assert read_info(path).step == 4  # the last checkpoint that was written, intact
    verify_checkpoint(path)
    # through the command line: one line, exit 2
    saves.clear()
    monkeypatch.setattr(safetensors.torch, "save_file", _full)
    line = _one_line_error(runner.invoke(app, ["train", "--resume", "--out", str(out)]))
    assert line == (
        f"attnkit: error: no space left on device while writing {path}; the previous checkpoint "
        f"is intact. (fix: free some space on that disk, then continue with: attnkit train "
        f"--resume --out {out})"
    )
    assert read_info(path).step == 4
    assert sorted(p.name for p in out.iterdir()) == [CHECKPOINT_NAME]


def test_a_full_disk_at_a_new_runs_first_save_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(safetensors.torch, "save_file", _full)
    out = tmp_path / "run"
    line = _one_line_error(runner.invoke(app, ["train", "--steps", "2", "--out", str(out)]))
    assert line == (
        f"attnkit: error: no space left on device while writing {out / CHECKPOINT_NAME}; no file "
        "was left there. (fix: free some space on that disk, then start the run again)"
    )
    assert list(out.iterdir()) == []


def test_a_full_disk_while_writing_the_maps_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np

    monkeypatch.setattr(np, "savez_compressed", _full)
    out = tmp_path / "run"
    line = _one_line_error(runner.invoke(app, ["train", "--steps", "2", "--out", str(out)]))
    assert line.startswith(
        f"attnkit: error: no space left on device while writing {out / 'attention.npz'}; no "
        "file was left there. (fix: "
    )
    assert sorted(p.name for p in out.iterdir()) == [CHECKPOINT_NAME]  # saved before the maps
    verify_checkpoint(out / CHECKPOINT_NAME)


# ---------------------------------------------------------------------------------------------
# a real full disk: a tmpfs of 256 KiB holds one checkpoint of TINY (175 KiB), not two


_FULL_DISK = """
import json, subprocess, sys
from pathlib import Path
from attnkit.train import TrainConfig, train
from attnkit.train.checkpoint import read_info

if __name__ == "__main__":
    out = Path(sys.argv[1]) / "run"
    train(TrainConfig(**json.loads(sys.argv[2])), out, stop_at=1)
    runs = []
    for extra in ([], ["--ddp", "2"]):
        cli = [sys.executable, "-m", "attnkit", "train", "--resume", "--out", str(out), *extra]
        done = subprocess.run(cli, capture_output=True, text=True)
        runs.append({"rc": done.returncode, "stderr": done.stderr,
                     "step": read_info(out / "checkpoint.safetensors").step,
                     "files": sorted(p.name for p in out.iterdir())})
    print(json.dumps(runs))
"""


def _can_mount_tmpfs(where: Path) -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    import subprocess

    probe = ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {where}"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def test_a_real_full_disk_is_one_line_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    """No monkeypatch: safetensors' own write fails with ENOSPC (a Rust error, ``os error
    28``), in one process and in a ``--ddp 2`` rank."""
    import subprocess
    import sys

    disk = tmp_path / "disk"
    disk.mkdir()
    if not _can_mount_tmpfs(disk):
        pytest.skip("needs root and a mount namespace (unshare -m) for a small tmpfs")
    script = tmp_path / "full_disk.py"
    script.write_text(_FULL_DISK)
    config = json.dumps(dataclasses.asdict(dataclasses.replace(TINY, checkpoint_every=1)))
    inner = 'mount -t tmpfs -o size=256k tmpfs "$1" && exec "$2" "$3" "$1" "$4"'
    command = ["unshare", "-m", "sh", "-c", inner, "sh", disk, sys.executable, script, config]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    path = disk / "run" / CHECKPOINT_NAME
    for run in json.loads(done.stdout.splitlines()[-1]):
        assert run["rc"] == 2, run["stderr"]
        errors = [line for line in run["stderr"].splitlines() if "error" in line]
        assert errors == [
            f"attnkit: error: no space left on device while writing {path}; the previous "
            f"checkpoint is intact. (fix: free some space on that disk, then continue with: "
            f"attnkit train --resume --out {path.parent})"
        ], run["stderr"]
        assert "Traceback" not in run["stderr"]
        assert run["step"] == 1
        assert run["files"] == [CHECKPOINT_NAME]  # no temporary file left on the full disk
