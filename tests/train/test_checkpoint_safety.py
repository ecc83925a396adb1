"""Hostile and damaged checkpoints: a flipped bit in a tensor's bytes, a stored config that would
allocate terabytes or is not a run's config, and links planted where the run writes. Each is
refused (one line and exit code 2 on the command line) before anything is allocated or
overwritten. A full disk while saving: test_checkpoint_full_disk.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import attnkit
import attnkit.train.loop as loop
from attnkit import AttentionInputError
from attnkit.cli import app
from attnkit.train import (
    CHECKPOINT_NAME,
    TrainConfig,
    build,
    load_checkpoint,
    resume_config,
    train,
    verify_checkpoint,
)
from attnkit.train.checkpoint import UncheckedCheckpointWarning
from checkpoints import TINY_RUN as TINY
from checkpoints import copy_run as _copy
from checkpoints import edit_checkpoint, flip_bit
from checkpoints import one_line_error as _one_line_error

_st = pytest.importorskip(
    "safetensors",
    reason="safetensors is not installed (the inspect extra: pip install '.[inspect]')",
)
import safetensors.torch  # noqa: E402

runner = CliRunner()

FIX = "resume from an intact copy, or start a new run with --overwrite"


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 2 of TINY's 10 steps, stopped there: its directory holds only the checkpoint."""
    out = tmp_path_factory.mktemp("made") / "run"
    train(TINY, out, stop_at=2)
    return out


def _weights(path: Path) -> list[str]:
    return sorted(k for k in safetensors.torch.load_file(str(path)) if k.startswith("model."))


# ---------------------------------------------------------------------------------------------
# a flipped bit in a tensor's bytes


@pytest.mark.parametrize("which", ["first weight", "last weight", "optimizer state"])
def test_a_flipped_bit_in_a_tensor_is_refused_naming_it(
    which: str, made: Path, tmp_path: Path
) -> None:
    out = _copy(made, tmp_path)
    path = out / CHECKPOINT_NAME
    names = sorted(safetensors.torch.load_file(str(path)))
    weights = [n for n in names if n.startswith("model.")]
    name = {
        "first weight": weights[0],
        "last weight": weights[-1],
        "optimizer state": next(n for n in names if n.endswith("exp_avg_sq")),
    }[which]
    flip_bit(path, name)
    damaged = path.read_bytes()
    _, model, opt = build(TINY.resolved())
    for load in (
        lambda: verify_checkpoint(path),
        lambda: load_checkpoint(path, model, opt),
        lambda: load_checkpoint(path, model),
        lambda: train(TINY, out, resume=True),
    ):
        with pytest.raises(AttentionInputError, match="does not match its checksum") as e:
            load()
        assert f"tensor {name} (" in e.value.problem
        assert "its bytes changed after it was saved (the file is damaged)" in e.value.problem
        assert e.value.fix == FIX
    line = _one_line_error(runner.invoke(app, ["train", "--resume", "--out", str(out)]))
    assert f"tensor {name} (" in line
    assert "does not match its checksum" in line
    assert path.read_bytes() == damaged  # refused before anything was written


def test_every_tensor_is_checksummed_and_a_round_trip_passes(made: Path) -> None:
    path = made / CHECKPOINT_NAME
    with _st.safe_open(str(path), framework="pt") as f:
        sums = json.loads(f.metadata()["checksums"])
    assert sums.keys() == safetensors.torch.load_file(str(path)).keys()
    assert all(len(v) == 64 and int(v, 16) >= 0 for v in sums.values())
    assert verify_checkpoint(path).step == 2


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"checksums": "{"}, "its metadata field 'checksums' is '{', not a JSON object of SHA-256"),
        ({"checksums": '{"model.x": 3}'}, "field 'checksums' is '{\"model.x\": 3}', not a JSON"),
        ({"checksums": "{}"}, "has no checksum (the file was edited)"),
    ],
)
def test_an_edited_checksum_field_is_refused(
    edit: dict[str, str], message: str, made: Path, tmp_path: Path
) -> None:
    path = _copy(made, tmp_path) / CHECKPOINT_NAME
    edit_checkpoint(path, **edit)
    with pytest.raises(AttentionInputError) as e:
        verify_checkpoint(path)
    assert message in e.value.problem, e.value.problem


def test_a_checksum_for_a_tensor_that_is_gone_is_refused(made: Path, tmp_path: Path) -> None:
    path = _copy(made, tmp_path) / CHECKPOINT_NAME
    with _st.safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    tensors = safetensors.torch.load_file(str(path))
    gone = _weights(path)[0]
    del tensors[gone]
    safetensors.torch.save_file(tensors, str(path), metadata=meta)
    with pytest.raises(AttentionInputError, match=f"tensor {gone} is missing"):
        verify_checkpoint(path)


def test_an_old_checkpoint_without_checksums_loads_with_one_warning(
    made: Path, tmp_path: Path
) -> None:
    out = _copy(made, tmp_path)
    path = out / CHECKPOINT_NAME
    edit_checkpoint(path, drop="checksums")
    with pytest.warns(UncheckedCheckpointWarning, match="has no checksums") as seen:
        assert verify_checkpoint(path).step == 2
    assert len(seen) == 1
    assert "\n" not in str(seen[0].message)
    _, model, opt = build(TINY.resolved())
    with pytest.warns(UncheckedCheckpointWarning):
        load_checkpoint(path, model, opt)
    # the CLI says it once, on one line, and the run goes on; its next save adds checksums
    result = runner.invoke(app, ["train", "--resume", "--out", str(out)])
    assert result.exit_code == 0, result.output
    warned = [line for line in result.stderr.splitlines() if "warning" in line.lower()]
    assert warned == [
        f"attnkit: warning: {path} has no checksums (written by an older attnkit): damage to "
        "its tensors cannot be detected; the next save of the run adds them."
    ], result.stderr
    with _st.safe_open(str(path), framework="pt") as f:
        assert "checksums" in f.metadata()
    verify_checkpoint(path)


# ---------------------------------------------------------------------------------------------
# a hostile stored config: checked before anything is allocated


@pytest.fixture
def nothing_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    def built(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built")

    monkeypatch.setattr(loop, "build", built)


HOSTILE: list[tuple[dict[str, Any], str, str]] = [
    # (stored settings changed, the argument refused, what the message says)
    ({"dim": 1048576}, "dim", "a run of dim=1048576, num_layers=1"),
    ({"num_layers": 10**9}, "num_layers", "num_layers=1000000000"),
    ({"batch_size": 10**9}, "batch_size", "batch_size=1000000000"),
    ({"test_size": 10**12}, "test_size", "test_size=1000000000000"),
    ({"length": 10**9}, "length", "length=1000000000"),
    ({"dim": -32}, "dim", "--dim must be a positive int, got -32."),
    ({"dim": 0}, "dim", "--dim must be a positive int, got 0."),
    ({"dim": 32.0}, "dim", "--dim must be a positive int, got 32.0."),
    ({"dim": "32"}, "dim", "--dim must be a positive int, got '32'."),
    ({"dim": None}, "dim", "--dim must be a positive int, got None."),
    ({"dim": True}, "dim", "--dim must be a positive int, got True."),
    ({"num_heads": 3}, "num_heads", "--num-heads must be a divisor of dim=32, got 3."),
    ({"lr": "0.01"}, "lr", "--lr must be a float > 0 and <= 3.4e37, got '0.01'."),
    ({"lr": True}, "lr", "--lr must be a float > 0 and <= 3.4e37, got True."),
    ({"lr": float("nan")}, "lr", "--lr must be a float > 0 and <= 3.4e37, got nan."),
    ({"clip": False}, "clip", "--clip must be a float > 0, or None, got False."),
    ({"weight_decay": "0"}, "weight_decay", "--weight-decay must be a float >= 0"),
    ({"target": "high"}, "target", "--target must be a fraction in (0, 1], or None, got 'high'."),
    ({"target": True}, "target", "--target must be a fraction in (0, 1], or None, got True."),
    ({"seed": 2**64}, "seed", "--seed must be an int in [0, 2**64), got 18446744073709551616."),
    ({"seed": -1}, "seed", "--seed must be an int in [0, 2**64), got -1."),
    ({"task": 5}, "task", "--task must be a task's name: reverse, sort, kv_recall, got 5."),
    ({"task": ["reverse"]}, "task", "--task must be a task's name"),
    ({"length": 7.5}, "length", "`length` must be an int >= 2."),
    ({"vocab": 1000}, "vocab", "`vocab` must be in [2, 26] for reverse."),
    ({"eval_every": -1}, "eval_every", "--eval-every must be a positive int, got -1."),
    ({"checkpoint_every": "often"}, "checkpoint_every", "--checkpoint-every must be a positive"),
    ({"dim": None, "drop": "dim"}, "dim", "setting 'dim' is missing"),
    ({"drop": "lr"}, "lr", "setting 'lr' is missing"),
    ({"length": None}, "length", "setting 'length' is missing"),
    ({"bogus": 1}, "config", "TypeError: TrainConfig.__init__() got an unexpected keyword"),
]


def _store(path: Path, changes: dict[str, Any]) -> None:
    stored = dataclasses.asdict(TINY.resolved())
    changes = dict(changes)
    drop = changes.pop("drop", None)
    stored.update(changes)
    if drop is not None:
        del stored[drop]
    edit_checkpoint(path, config=json.dumps(stored))


@pytest.mark.parametrize(
    ("changes", "argument", "message"), HOSTILE, ids=[str(c) for c, _, _ in HOSTILE]
)
@pytest.mark.usefixtures("nothing_is_built")
def test_a_hostile_stored_config_is_refused_before_anything_is_allocated(
    changes: dict[str, Any], argument: str, message: str, made: Path, tmp_path: Path
) -> None:
    out = _copy(made, tmp_path)
    _store(out / CHECKPOINT_NAME, changes)
    before = (out / CHECKPOINT_NAME).read_bytes()
    previous = attnkit.set_memory_limit(8 * 2**30)  # the same verdict on any machine
    try:
        with pytest.raises(AttentionInputError) as e:
            train(resume_config(out), out, resume=True)
        line = _one_line_error(runner.invoke(app, ["train", "--resume", "--out", str(out)]))
    finally:
        attnkit.set_memory_limit(previous)
    assert message in e.value.problem, e.value.problem
    assert message in line
    if "memory limit" in e.value.problem:  # checked by the memory guard, naming the settings
        assert e.value.argument == argument
        assert "nothing was allocated" in e.value.problem
        assert "above attnkit's memory limit of 8 GiB" in e.value.problem
    else:  # the stored settings themselves: the file was edited
        assert "its stored settings are not a valid run" in e.value.problem
        assert e.value.fix == FIX
    assert (out / CHECKPOINT_NAME).read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == [CHECKPOINT_NAME]


@pytest.mark.usefixtures("nothing_is_built")
def test_a_new_run_too_big_for_memory_is_refused_before_it_starts(tmp_path: Path) -> None:
    previous = attnkit.set_memory_limit(2**30)
    try:
        for config, argument in (
            (dataclasses.replace(TINY, dim=2**20, num_heads=4), "dim"),
            (dataclasses.replace(TINY, batch_size=2**22), "batch_size"),
            (dataclasses.replace(TINY, eval_size=10**9), "eval_size"),
        ):
            with pytest.raises(attnkit.AttentionMemoryError) as e:
                train(config, tmp_path / "run")
            assert e.value.argument == argument
            assert e.value.limit == 2**30
            assert e.value.nbytes > 2**30
        with pytest.raises(AttentionInputError, match="--seed must be an int in"):
            train(dataclasses.replace(TINY, seed=2**64), tmp_path / "run")
    finally:
        attnkit.set_memory_limit(previous)
    assert not (tmp_path / "run").exists()


def test_the_parameter_count_without_a_model_is_exact() -> None:
    from attnkit.train import TaskModel
    from attnkit.train.guards import model_parameters

    for config in (
        TINY,
        TrainConfig(),
        TrainConfig(task="kv_recall", dim=48, num_heads=3, num_layers=3),
        TrainConfig(task="sort", vocab=5, length=7, dim=8, num_heads=8),
    ):
        model = TaskModel(config.resolved().model_config())
        assert model_parameters(config.resolved()) == sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# links planted where the run writes


def test_planted_links_at_the_runs_files_are_replaced_never_followed(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    victims = {}
    for name in (CHECKPOINT_NAME, "attention.html", "attention.png", "attention.npz"):
        victim = tmp_path / f"victim-{name}"
        victim.write_text(f"the user's {name}")
        (out / name).symlink_to(victim)
        victims[name] = victim
    stale = out / (CHECKPOINT_NAME + ".tmp")  # a planted legacy temporary name
    stale.symlink_to(tmp_path / "victim-tmp")
    (tmp_path / "victim-tmp").write_text("keep")
    result = train(dataclasses.replace(TINY, steps=2), out, overwrite=True)
    assert result.maps is not None
    for name, victim in victims.items():
        assert victim.read_text() == f"the user's {name}"
        assert not (out / name).is_symlink()
        assert (out / name).stat().st_size > 0
    assert (tmp_path / "victim-tmp").read_text() == "keep"
    assert not stale.is_symlink()  # removed: the link, not its target
    verify_checkpoint(out / CHECKPOINT_NAME)
    assert sorted(p.name for p in out.iterdir()) == sorted(victims)


def test_new_files_of_a_run_get_the_umask_not_0600(tmp_path: Path) -> None:
    previous = os.umask(0o022)
    try:
        result = train(dataclasses.replace(TINY, steps=2), tmp_path / "run")
    finally:
        os.umask(previous)
    assert result.maps is not None
    for path in (result.checkpoint, *result.maps.paths.values()):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_a_stale_temporary_file_of_a_killed_save_is_removed(made: Path, tmp_path: Path) -> None:
    out = _copy(made, tmp_path)
    stale = out / f".{CHECKPOINT_NAME}.k1ll3d.tmp"
    stale.write_bytes(b"half of a checkpoint")
    verify_checkpoint(out / CHECKPOINT_NAME)
    assert sorted(p.name for p in out.iterdir()) == [CHECKPOINT_NAME]


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's link needs root")
def test_an_out_directory_linked_by_another_user_is_refused_before_any_work(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    link = tmp_path / "run"
    link.symlink_to(home)
    os.lchown(link, 12345, 12345)
    with pytest.raises(AttentionInputError, match="symbolic link owned by another user") as e:
        train(TINY, link)
    assert e.value.argument == "out"
    line = _one_line_error(runner.invoke(app, ["train", "--out", str(link)]))
    assert "is a symbolic link owned by another user (uid 12345)" in line
    assert list(home.iterdir()) == []


def test_checksums_are_of_the_bytes_safetensors_stores(tmp_path: Path) -> None:
    import hashlib
    import struct

    from attnkit.train.checkpoint import _digest

    for t in (
        torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        torch.tensor(3.0),
        torch.zeros(0),
        torch.tensor([True, False]),
        torch.arange(-3, 3, dtype=torch.int64),
        torch.arange(12.0).reshape(3, 4).t(),  # not contiguous: hashed in C order, as stored
    ):
        path = tmp_path / "one.safetensors"
        safetensors.torch.save_file({"t": t.contiguous()}, str(path))
        data = path.read_bytes()
        (size,) = struct.unpack("<Q", data[:8])
        begin, end = json.loads(data[8 : 8 + size])["t"]["data_offsets"]
        stored = data[8 + size + begin : 8 + size + end]
        assert _digest(t) == hashlib.sha256(stored).hexdigest(), t.dtype
