"""What a training run refuses before it starts, and how it stops without losing a run.

Checked before any work (:meth:`attnkit.train.RunOptions.check` calls these), each with an
:class:`~attnkit.AttentionInputError` that names the option:

- the output directory: not empty, not a file, can be created and written; an existing
  checkpoint there is never replaced unless asked (``resume`` continues it, ``overwrite``
  starts a new run over it);
- the device, the number of processes (at most :func:`max_processes`), the threads;
- the memory the run would take (:func:`run_bytes`: the model with its gradients and AdamW
  state, a batch's activations, the held-out sets) against attnkit's memory limit
  (:mod:`attnkit.memory`), so that a config of ``dim=1048576`` is refused, not allocated;
- on resume, that the checkpoint's settings are complete and valid (:func:`check_complete`:
  every field there, none unknown, each in the range its option takes) and that the checkpoint
  is the run asked for and holds only intact, finite tensors
  (:func:`attnkit.train.checkpoint.verify_checkpoint`).

While training, the first non-finite loss (or weights that became non-finite) stops the run
with :class:`TrainingDivergedError`, before the step and before any save: the last checkpoint
written stays the last good one. A first Ctrl-C stops after the current step
(:func:`sigint_stops`).
"""

from __future__ import annotations

import errno
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from attnkit import files, memory
from attnkit.errors import AttentionInputError
from attnkit.files import WriteError
from attnkit.train.checkpoint import CHECKPOINT_NAME, read_info
from attnkit.train.tasks import Task, make_task

__all__ = [
    "TrainingDivergedError",
    "check_complete",
    "check_device",
    "check_memory",
    "check_out",
    "check_same_run",
    "check_world",
    "config_error",
    "diverged",
    "first_non_finite",
    "is_number",
    "max_processes",
    "model_parameters",
    "run_bytes",
    "save_failed",
    "saved_config_error",
    "sigint_stops",
]

WHERE = "attnkit train"


class TrainingDivergedError(RuntimeError):
    """The loss (or the weights) became NaN or infinite: the run stopped before that step and
    wrote nothing; ``checkpoint_step`` is the step of the last good checkpoint of this run
    (``None`` when it wrote none)."""

    def __init__(self, message: str, step: int, checkpoint_step: int | None) -> None:
        super().__init__(message, step, checkpoint_step)
        self.step = step
        self.checkpoint_step = checkpoint_step

    def __str__(self) -> str:
        return str(self.args[0])


def diverged(what: str, step: int, total: int, out: Path, saved: int | None) -> str:
    """The one-line message of a :class:`TrainingDivergedError`."""
    kept = (
        f"the checkpoint of step {saved} in {out} is the last good one (--resume continues it)"
        if saved is not None
        else "this run wrote no checkpoint"
    )
    return (
        f"training stopped at step {step} of {total}: {what}; nothing of that step was saved, "
        f"{kept}. A lower learning rate or another --seed usually avoids it."
    )


def config_error(name: str, value: object, expected: str) -> AttentionInputError:
    """A setting of the run out of its range; the message names its command-line option."""
    flag = "--" + name.replace("_", "-")
    return AttentionInputError(
        "attnkit.train.TrainConfig",
        name,
        f"{flag} must be {expected}, got {value!r}.",
        got=f"{name}={value!r}",
        expected=expected,
    )


def is_number(value: object) -> bool:
    """An int or a float, not a bool (JSON's ``true`` is no learning rate)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_complete(stored: dict[str, Any], config: Any) -> None:
    """On resume: the checkpoint's settings ``stored`` name every field of ``config`` (a
    ``TrainConfig`` built from them), with the task's sizes filled in. A missing one would be
    silently taken from today's defaults."""
    for f in fields(config):
        if f.name not in stored or (f.name in ("length", "vocab") and stored[f.name] is None):
            raise AttentionInputError(
                "attnkit.train.resume_config",
                f.name,
                f"setting {f.name!r} is missing",
                got=", ".join(sorted(stored)),
                expected=", ".join(g.name for g in fields(config)),
            )


def model_parameters(config: Any) -> int:
    """The parameters of the :class:`~attnkit.train.TaskModel` of ``config`` (a
    ``TrainConfig``), counted without building it: exact for any size.

    >>> from attnkit.train import TrainConfig
    >>> model_parameters(TrainConfig())
    103184
    """
    task: Task = config.make_task()
    E, L, C = int(config.dim), int(config.num_layers), task.num_classes
    layer = 12 * E * E + 13 * E  # q, k, v, out (E x E + E each), 2 LayerNorms, MLP E -> 4E -> E
    embeddings = (task.vocab_size + task.length) * E
    return embeddings + L * layer + 2 * E + E * C + C


_EVAL_CHUNK = 2048  # as attnkit.train.loop: sequences per forward pass in evaluation
_DRAW = 12  # a held-out draw samples (HOLDOUT_EVERY + 2) x n sequences to keep n


def run_bytes(config: Any, world_size: int = 1) -> dict[str, int]:
    """About the bytes a run of ``config`` (a resolved ``TrainConfig``) takes, by part:
    ``model`` (parameters, gradients and AdamW's two moments, float32, in each process),
    ``batch`` (a training step's activations, all processes together) and ``held-out`` (the
    eval and test sets and an evaluation's activations). An estimate, made to refuse runs that
    cannot fit, not to plan them to the byte."""
    E, L, H, B, T = (
        config.dim,
        config.num_layers,
        config.num_heads,
        config.batch_size,
        config.length,
    )
    C = config.make_task().num_classes
    P = model_parameters(config)
    model = 4 * P * (4 if world_size == 1 else 5) * world_size  # DDP: a gradient bucket copy
    batch = 4 * B * T * (L * (16 * E + 3 * H * T) + 3 * E + 3 * C)
    n = max(config.eval_size, config.test_size)
    chunk = min(_EVAL_CHUNK, n)
    evaluation = 4 * chunk * T * (8 * E + 2 * H * T + C)
    data = 8 * T * (2 * (config.eval_size + config.test_size) + 3 * _DRAW * n)
    return {"model": model, "batch": batch, "held-out": evaluation + data}


_SIZES = (
    "dim",
    "num_layers",
    "num_heads",
    "length",
    "vocab",
    "batch_size",
    "eval_size",
    "test_size",
)


def _furthest_above_default(config: Any) -> str:
    """The size setting of ``config`` with the largest ratio to its default: the one to name."""
    task = make_task(config.task)  # the task's default sizes
    defaults = {f.name: f.default for f in fields(config)} | {
        "length": task.length,
        "vocab": task.vocab,
    }
    return max(_SIZES, key=lambda name: getattr(config, name) / defaults[name])


def check_memory(config: Any, device: torch.device, world_size: int = 1) -> None:
    """Refuse a run whose :func:`run_bytes` exceed attnkit's memory limit on ``device``
    (:func:`attnkit.memory.memory_limit`), before anything is allocated, naming the settings."""
    parts = run_bytes(config, world_size)
    total = sum(parts.values())
    limit = memory.exceeds(total, device)
    if limit is None:
        return
    argument = _furthest_above_default(config)
    c = config
    what = (
        f"a run of dim={c.dim}, num_layers={c.num_layers}, num_heads={c.num_heads}, "
        f"length={c.length}, vocab={c.vocab}, batch_size={c.batch_size}, "
        f"eval_size={c.eval_size}, test_size={c.test_size} ({model_parameters(c):,} parameters"
        f"{f', {world_size} processes' if world_size > 1 else ''})"
    )
    raise memory.refuse(
        WHERE,
        argument,
        what,
        total,
        limit,
        got=", ".join(f"{k} {memory.format_bytes(v)}" for k, v in parts.items()),
        fix=f"train a smaller run ({argument}={getattr(config, argument)} is the setting furthest "
        "above its default); a resumed run keeps its checkpoint's settings, so start a new one",
    )


def save_failed(e: WriteError, out: Path, saved: int | None) -> WriteError:
    """A checkpoint of the run in ``out`` that could not be written (``saved``: the step of
    the run's last checkpoint, ``None`` when it wrote none): ``e`` said by ``attnkit train``,
    with the way on for a full disk."""
    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return e.at(WHERE, "out")
    if saved is None:
        return e.at(WHERE, "out", fix="free some space on that disk, then start the run again")
    again = f"attnkit train --resume --out {out}"
    return e.at(WHERE, "out", fix=f"free some space on that disk, then continue with: {again}")


def saved_config_error(path: Path, e: Exception) -> AttentionInputError:
    """A checkpoint whose stored settings are not a run's settings (an edited file)."""
    what = e.problem if isinstance(e, AttentionInputError) else f"{type(e).__name__}: {e}"
    return AttentionInputError(
        "attnkit.train.resume_config",
        "checkpoint",
        f"{path}: its stored settings are not a valid run ({' '.join(what.split())}); the file "
        "was edited or damaged.",
        got=str(path),
        expected=f"a {CHECKPOINT_NAME} written by attnkit train",
        fix="resume from an intact copy, or start a new run with --overwrite",
    )


def max_processes() -> int:
    """The most processes ``--ddp`` starts: one per CPU core (``os.cpu_count()``), and 2 on a
    machine with fewer cores, so that DDP can always be tried. Each process holds its own torch
    (a few hundred MB); more processes than cores only wait for each other."""
    return max(2, os.cpu_count() or 1)


def check_world(batch_size: int, world_size: int) -> None:
    """``--ddp``: a positive int, at most :func:`max_processes`, that divides the batch."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise AttentionInputError(
            WHERE,
            "ddp",
            f"--ddp must be a positive number of processes, got {world_size!r}.",
            got=f"ddp={world_size!r}",
            expected="an int >= 1",
            fix="--ddp 2 trains with two processes",
        )
    if batch_size % world_size:
        ways = [str(n) for n in range(2, max_processes() + 1) if batch_size % n == 0][:3]
        raise AttentionInputError(
            WHERE,
            "ddp",
            f"--ddp {world_size} does not divide the batch of {batch_size} sequences "
            "into equal shards.",
            got=f"batch_size={batch_size}, ddp={world_size}",
            expected="batch_size % ddp == 0",
            fix=f"use --ddp {' or '.join(ways)}" if ways else "train with one process",
        )
    most = max_processes()
    if world_size > most:
        raise AttentionInputError(
            WHERE,
            "ddp",
            f"--ddp {world_size} is more processes than this machine runs at once: at most "
            f"{most} (one per CPU core, os.cpu_count() = {os.cpu_count()}).",
            got=f"ddp={world_size}",
            expected=f"1 <= ddp <= {most}",
            fix=f"pass --ddp {most} or fewer",
        )


def check_device(device: str, world_size: int) -> torch.device:
    """``--device``: cpu, or cuda where there is one (one process)."""

    def bad(problem: str, fix: str) -> AttentionInputError:
        return AttentionInputError(
            WHERE, "device", problem, got=f"device={device!r}", expected="cpu", fix=fix
        )

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise bad(f"unknown device {device!r}.", "pass --device cpu (or cuda)") from None
    if dev.type not in ("cpu", "cuda"):
        raise bad(f"device type {dev.type!r} is not supported.", "pass --device cpu (or cuda)")
    if world_size > 1 and dev.type != "cpu":
        raise bad("--ddp runs on the CPU (gloo).", "pass --device cpu with --ddp")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise bad("--device cuda, but this torch sees no CUDA device.", "pass --device cpu")
    return dev


def _out_error(out: object, problem: str, fix: str) -> AttentionInputError:
    return AttentionInputError(
        WHERE,
        "out",
        f"--out {problem}",
        got=f"--out {out}",
        expected="a directory that exists or can be created, and can be written",
        fix=fix,
    )


def _check_writable(out: Path) -> None:
    """``out`` (or, when it does not exist yet, its nearest existing parent) is a directory
    this process can write: probed with a temporary file, which is removed again."""
    if out.exists() and not out.is_dir():
        raise _out_error(out, f"{out} is a file, not a directory.", "pass --out a directory")
    try:
        files.check_directory(out, where=WHERE, argument="out")
    except files.WriteError as e:
        raise _out_error(out, e.problem, e.fix or "") from None
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise _out_error(
            out, f"{out} cannot be created: {probe} is a file.", "pass --out a directory"
        )
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".attnkit-probe-")
    except OSError as e:
        raise _out_error(
            out,
            f"{out} cannot be written: {probe}: {e.strerror or e}.",
            "pass --out a directory you have permission to write",
        ) from None
    os.close(fd)
    os.unlink(name)


def check_out(out: str | os.PathLike[str], *, resume: bool, overwrite: bool) -> Path:
    """``--out``: usable, and never a silent overwrite of the run whose checkpoint is there."""
    if str(out) == "":
        raise _out_error("''", "is empty.", "pass --out DIR (default: attnkit-train)")
    path = Path(out)
    _check_writable(path)
    if resume and overwrite:
        raise AttentionInputError(
            WHERE,
            "overwrite",
            "--resume continues the run in --out and --overwrite replaces it: pass one of them.",
            got="--resume --overwrite",
            expected="at most one of --resume, --overwrite",
            fix="leave out --overwrite to continue the run, or --resume to start again",
        )
    checkpoint = path / CHECKPOINT_NAME
    if checkpoint.exists() and not checkpoint.is_file():
        raise _out_error(
            path,
            f"{checkpoint} is there but is not a file: the run writes its checkpoint at that path.",
            f"remove or rename {checkpoint}, or pass another --out",
        )
    if not resume and not overwrite and checkpoint.exists():
        try:
            info = read_info(checkpoint)
            at = f" (step {info.step}{', finished' if info.finished else ''})"
        except AttentionInputError:
            at = ""
        raise _out_error(
            path,
            f"{path} already holds a run's checkpoint{at}; a new run would overwrite it.",
            "pass --resume to continue that run, or --overwrite to start a new run over it",
        )
    return path


def check_same_run(config: Any, saved: Any, out: Path) -> None:
    """On resume: ``config`` (a ``TrainConfig``) must be the checkpoint's (``saved``)."""
    for f in fields(config):
        ours, theirs = getattr(config, f.name), getattr(saved, f.name)
        if ours != theirs:
            flag = "--" + f.name.replace("_", "-")
            raise AttentionInputError(
                WHERE,
                f.name,
                f"--resume continues the run in {out}, which has {f.name}={theirs!r}, "
                f"but {f.name}={ours!r} was asked for.",
                got=f"{f.name}={ours!r}",
                expected=f"{f.name}={theirs!r} (the checkpoint's)",
                fix=f"leave out {flag}, or start a new run without --resume",
            )


def first_non_finite(model: torch.nn.Module) -> str | None:
    """The first parameter of ``model`` that holds a NaN or an infinity, or ``None``."""
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            return name
    return None


@contextmanager
def sigint_stops() -> Iterator[Callable[[], bool]]:
    """In the main thread, a first Ctrl-C asks the loop to stop after the current step (it then
    saves a checkpoint); a second one interrupts at once."""
    asked = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield asked.is_set
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: object) -> None:
        if asked.is_set():
            raise KeyboardInterrupt
        asked.set()

    signal.signal(signal.SIGINT, handler)
    try:
        yield asked.is_set
    finally:
        signal.signal(signal.SIGINT, previous)
