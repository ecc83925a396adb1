"""``--ddp N``: train with N processes, DistributedDataParallel over gloo on loopback.

:func:`spawn` starts N processes with ``torch.multiprocessing`` (spawn); each sets
``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``, joins the process group (gloo, with a
timeout) and runs :func:`attnkit.train.loop.fit` as its rank; the model is wrapped in
``DistributedDataParallel`` there. Rank 0 sends its :class:`~attnkit.train.loop.Progress`
reports and, at the end, its :class:`~attnkit.train.loop.FitSummary` through a queue; this
process relays the reports to the caller. A rank that fails becomes a
:class:`DistributedTrainingError` here, with one line to show and the rank's traceback in
``detail``; the other ranks are terminated. A run whose loss became non-finite stops on every
rank at the same step; rank 0 sends the :class:`~attnkit.train.guards.TrainingDivergedError`,
raised again here, and so the :class:`~attnkit.files.WriteError` of a checkpoint it could not
write (a full disk; the other ranks then fail, and that error is the one raised).
"""

from __future__ import annotations

import gc
import os
import socket
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from attnkit.files import WriteError
from attnkit.train.checkpoint import UncheckedCheckpointWarning
from attnkit.train.guards import TrainingDivergedError
from attnkit.train.loop import FitSummary, Progress, TrainConfig, fit

__all__ = ["INIT_TIMEOUT_S", "DistributedTrainingError", "spawn"]

INIT_TIMEOUT_S = 60  # init_process_group gives up after this long


class DistributedTrainingError(RuntimeError):
    """A rank of a ``--ddp`` run failed: a one-line message; the rank's traceback in ``detail``."""

    def __init__(self, message: str, *, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _worker(
    rank: int,
    world_size: int,
    port: int,
    config: TrainConfig,
    out: Path,
    resume: bool,
    threads: int,
    stop_at: int | None,
    queue: Any,
) -> None:
    import torch.distributed as dist

    # the parent process checked the checkpoint and said once if it has no checksums
    warnings.filterwarnings("ignore", category=UncheckedCheckpointWarning)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=INIT_TIMEOUT_S)
    )
    summary: FitSummary | TrainingDivergedError | WriteError
    try:
        try:
            summary = fit(
                config,
                out,
                resume=resume,
                rank=rank,
                world_size=world_size,
                device=torch.device("cpu"),
                stop_at=stop_at,
                emit=queue.put,
                should_stop=lambda: False,
            )
        except WriteError as e:  # rank 0 could not save (a full disk): sent as it is
            if rank != 0:
                raise
            summary = e.with_traceback(None)
        except TrainingDivergedError as e:  # every rank stops at the same step
            # without its traceback: the exception would otherwise keep fit's frames, and with
            # them its DistributedDataParallel wrapper, alive past destroy_process_group below
            # (a rank then aborted at exit: "terminate called without an active exception")
            summary = e.with_traceback(None)
        if rank == 0:
            queue.put(summary)
    finally:
        # every rank, every way out: fit's DistributedDataParallel wrapper can outlive fit in a
        # reference cycle, and one freed after destroy_process_group (at exit) aborts the rank
        # with "terminate called without an active exception" (seen once on rank 1 of a run
        # that succeeded, in CI); collected here, it goes while its process group is alive
        gc.collect()
        dist.destroy_process_group()


def spawn(
    config: TrainConfig,
    out: Path,
    *,
    world_size: int,
    resume: bool,
    threads: int,
    stop_at: int | None,
    emit: Callable[[Progress], None],
) -> FitSummary:
    """Run :func:`~attnkit.train.loop.fit` on ``world_size`` spawned processes, each with
    ``threads`` torch threads (the run checked already, see :class:`attnkit.train.RunOptions`).

    Rank 0's progress reports are passed to ``emit`` here, in the calling process.
    """
    import queue as queue_module

    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException, start_processes

    queue = mp.get_context("spawn").Queue()
    args = (world_size, _free_port(), config, out, resume, threads, stop_at, queue)
    context = start_processes(  # type: ignore[no-untyped-call]
        _worker, args=args, nprocs=world_size, join=False, start_method="spawn"
    )
    result: FitSummary | TrainingDivergedError | WriteError | None = None

    def drain(block: bool) -> None:
        nonlocal result
        while True:
            try:
                message = queue.get(timeout=0.05) if block else queue.get_nowait()
            except queue_module.Empty:
                return
            block = False
            if isinstance(message, Progress):
                emit(message)
            elif isinstance(message, (FitSummary, TrainingDivergedError, WriteError)):
                result = message

    try:
        done = False
        while not done:
            drain(block=True)
            try:
                done = context.join(timeout=0.01)
            except ProcessException as e:
                drain(block=False)
                if isinstance(result, WriteError):  # rank 0 stopped the run; the others broke
                    raise result from None
                lines = [line for line in str(e).splitlines() if line.strip()]
                raise DistributedTrainingError(
                    f"rank {e.error_index} of the --ddp {world_size} run failed: "
                    f"{lines[-1].strip() if lines else type(e).__name__}",
                    detail=str(e),
                ) from None
        drain(block=False)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    if result is None:
        raise DistributedTrainingError(f"the --ddp {world_size} run ended without a result")
    if isinstance(result, (TrainingDivergedError, WriteError)):
        raise result
    return result
