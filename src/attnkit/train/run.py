"""A whole ``attnkit train`` run: checked once (:class:`RunOptions`), then trained, tested and its
attention maps written (:func:`train`).

Every question about a run is asked once, before any work: :meth:`RunOptions.prepare` checks
the settings, the ``--out`` directory and, on resume, reads the checkpoint's settings and
verifies the checkpoint, and returns a :class:`CheckedRun`; :func:`train` given that
``checked`` run does not check it again. The training itself is :func:`attnkit.train.loop.fit`,
in this process or in the ``--ddp`` processes that :func:`attnkit.train.ddp.spawn` starts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

import attnkit.train.guards as guards
import attnkit.train.loop as loop
from attnkit.errors import AttentionInputError
from attnkit.train.checkpoint import CHECKPOINT_NAME, load_checkpoint, verify_checkpoint
from attnkit.train.ddp import spawn
from attnkit.train.head_alignment import MapsReport, write_maps
from attnkit.train.loop import FitSummary, Progress, TrainConfig, resume_config
from attnkit.train.tasks import Accuracy

__all__ = ["CheckedRun", "RunOptions", "TrainResult", "train"]


@dataclass(frozen=True)
class RunOptions:
    """How :func:`train` runs a config (every keyword of :func:`train` but ``progress`` and
    ``checked``)."""

    resume: bool = False
    overwrite: bool = False
    world_size: int = 1
    device: str = "cpu"
    threads: int = 1
    stop_at: int | None = None

    def check(self, config: TrainConfig, out: str | os.PathLike[str]) -> TrainConfig:
        """Check a run without training; return the resolved config.

        Raises :class:`~attnkit.AttentionInputError` for what :func:`train` would refuse: bad
        settings, an unusable ``out``, an existing checkpoint in ``out`` without ``resume`` or
        ``overwrite``, and on resume a checkpoint of another run, edited, or holding a NaN.
        """
        return self.prepare(config, out).config

    def prepare(self, config: TrainConfig, out: str | os.PathLike[str]) -> CheckedRun:
        """Check a run as :meth:`check` does; return it checked, for ``train(checked=...)``."""
        config = self._check_settings(config)
        path = guards.check_out(out, resume=self.resume, overwrite=self.overwrite)
        return self._checked(config, path, resume_config(path) if self.resume else None)

    def prepare_given(self, out: str | os.PathLike[str], given: Mapping[str, Any]) -> CheckedRun:
        """Check the run of the settings ``given`` (``TrainConfig`` fields) in ``out``, as the
        command line asks for it: a new run of ``TrainConfig(**given)``, or on resume the run
        whose checkpoint is in ``out``, where each setting given must be the checkpoint's.
        ``out`` is checked first, then the settings."""
        path = guards.check_out(out, resume=self.resume, overwrite=self.overwrite)
        saved = resume_config(path) if self.resume else None
        # on resume the checkpoint's settings, except those given
        config = TrainConfig(**given) if saved is None else replace(saved, **given)
        return self._checked(self._check_settings(config), path, saved)

    def _check_settings(self, config: TrainConfig) -> TrainConfig:
        """The resolved ``config``, checked with the device, processes, memory and threads."""
        config = config.resolved()
        device = guards.check_device(self.device, self.world_size)
        guards.check_world(config.batch_size, self.world_size)
        guards.check_memory(config, device, self.world_size)  # before anything is allocated
        threads, stop_at = self.threads, self.stop_at
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise guards.config_error("threads", threads, "a positive int")
        if stop_at is not None and (not isinstance(stop_at, int) or stop_at < 1):
            raise guards.config_error("stop_at", stop_at, "a positive int, or None")
        return config

    def _checked(self, config: TrainConfig, path: Path, saved: TrainConfig | None) -> CheckedRun:
        """On resume (``saved``: the checkpoint's config), ``config`` is that run and the
        checkpoint intact: every tensor finite and matching its checksum."""
        if saved is not None:
            guards.check_same_run(config, saved, path)
            verify_checkpoint(path / CHECKPOINT_NAME)
        return CheckedRun(config, path, self)


@dataclass(frozen=True)
class CheckedRun:
    """A run that passed every check of :meth:`RunOptions.prepare`: its resolved ``config``,
    its ``out`` directory and its ``options``."""

    config: TrainConfig
    out: Path
    options: RunOptions


@dataclass(frozen=True)
class TrainResult:
    """What :func:`train` did: the fit, the final held-out test and the maps (not when
    ``fit.stopped``), the checkpoint and the total wall time."""

    config: TrainConfig
    fit: FitSummary
    test: Accuracy | None
    maps: MapsReport | None
    checkpoint: Path
    world_size: int
    seconds: float


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _same_run(checked: CheckedRun, config: TrainConfig, out: Path, options: RunOptions) -> None:
    """``checked`` was made for these arguments of :func:`train`."""
    if checked.out != out:
        problem = f"checked was checked for the run in {checked.out}, not for out={out}."
    elif checked.options != options or config not in (checked.config, config.resolved()):
        problem = "checked was checked for another run: other settings or other options."
    else:
        return
    raise AttentionInputError(
        "attnkit.train.train",
        "checked",
        problem,
        got=f"checked.options={checked.options}",
        expected=f"what RunOptions(...).prepare(config, out) returned for {options}",
        fix="pass the arguments the run was checked with, or leave out checked",
    )


def train(
    config: TrainConfig,
    out: str | os.PathLike[str],
    *,
    resume: bool = False,
    overwrite: bool = False,
    world_size: int = 1,
    device: str = "cpu",
    threads: int = 1,
    stop_at: int | None = None,
    progress: Callable[[Progress], None] | None = None,
    checked: CheckedRun | None = None,
) -> TrainResult:
    """Train a :class:`~attnkit.train.TaskModel` on ``config.task``; checkpoint, test and write
    maps to ``out``.

    - ``resume``: continue the run whose checkpoint is in ``out`` (``config`` must be its config,
      see :func:`~attnkit.train.loop.resume_config`).
    - ``overwrite``: start a new run in an ``out`` that holds another run's checkpoint, which
      the new run's first checkpoint replaces. Without it (or ``resume``) that is refused.
    - ``world_size``: the number of processes (DistributedDataParallel over gloo, CPU).
    - ``threads``: torch threads per process. One is the default: on these small matrices a
      second thread costs more in synchronisation than it gains.
    - ``stop_at``: stop after this step with a checkpoint, as if interrupted.
    - ``progress``: called with a :class:`~attnkit.train.loop.Progress` after each step (in
      this process).
    - ``checked``: what :meth:`RunOptions.prepare` returned for these same arguments; the run
      is then not checked again. One checked for other arguments is refused.

    After the fit (unless it stopped early), the trained model is checked on ``test_size``
    fresh held-out sequences and the attention maps of one of them are written to ``out``
    (``attention.html``, ``.png``, ``.npz``; see :func:`attnkit.train.head_alignment.write_maps`).

    Raises :class:`~attnkit.train.guards.TrainingDivergedError` at the first non-finite loss,
    before that step is taken; the checkpoint in ``out`` is then the run's last good one.
    """
    t0 = time.perf_counter()
    options = RunOptions(resume, overwrite, world_size, device, threads, stop_at)
    if checked is None:
        checked = options.prepare(config, out)
    else:
        _same_run(checked, config, Path(out), options)
    config, out = checked.config, checked.out
    dev = torch.device(device)
    out.mkdir(parents=True, exist_ok=True)
    emit = progress or (lambda p: None)
    with _threads(threads):
        if world_size == 1:
            with guards.sigint_stops() as should_stop:
                summary = loop.fit(
                    config,
                    out,
                    resume=resume,
                    rank=0,
                    world_size=1,
                    device=dev,
                    stop_at=stop_at,
                    emit=emit,
                    should_stop=should_stop,
                )
        else:
            summary = spawn(
                config,
                out,
                world_size=world_size,
                resume=resume,
                threads=threads,
                stop_at=stop_at,
                emit=emit,
            )
        test = maps = None
        if not summary.stopped:
            task, model, _ = loop.build(config, dev)
            load_checkpoint(out / CHECKPOINT_NAME, model)
            test_x, test_y = loop.held_out_set(config, task, test=True)
            test = loop.evaluate(model, test_x, test_y)
            maps = write_maps(task, model, test_x[0], out)  # the first test sequence
    seconds = time.perf_counter() - t0
    return TrainResult(config, summary, test, maps, out / CHECKPOINT_NAME, world_size, seconds)
