"""The training loop of ``attnkit train``: AdamW, warm-up and cosine decay, held-out evaluation,
early stop, safetensors checkpoints, resume, and DistributedDataParallel over gloo.

Dimension legend: B sequences per step (all processes together), T tokens, C output classes.

**Determinism.** The batch of step ``s`` is drawn from a generator seeded with ``(seed, s)``; the
model is initialised from ``seed``; the learning rate is a function of ``s``; there is no
dropout. So a run is a function of its :class:`TrainConfig`, and the checkpoint (model,
optimizer, step) is its whole state: ``--resume`` from step ``K`` gives bit for bit the
parameters of a straight run (same thread count and world size; a different one changes only
the rounding of the sums).

**DDP** (:mod:`attnkit.train.ddp` starts the processes). With ``world_size = N`` every
rank draws the same global batch of ``B`` sequences and trains on its own shard, rows
``[r B/N, (r+1) B/N)``. DistributedDataParallel averages the gradients over the ranks, which is
the gradient of the global batch (every shard scores the same number of positions), so N
processes follow one process up to rounding. Rank 0 evaluates, decides the early stop
(broadcast to the others), writes checkpoints and reports progress.

**Never losing a run** (:mod:`attnkit.train.guards`). Everything is checked before the first
step; a new run never replaces an existing checkpoint unless ``overwrite``; the first
non-finite loss stops the run with :class:`~attnkit.train.guards.TrainingDivergedError` before
that step is taken or saved, so the last checkpoint stays the last good one.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from attnkit.configs import derive_config
from attnkit.errors import AttentionInputError
from attnkit.files import WriteError
from attnkit.train import guards
from attnkit.train.checkpoint import (
    CHECKPOINT_NAME,
    load_checkpoint,
    read_info,
    save_checkpoint,
    verify_checkpoint,
)
from attnkit.train.guards import TrainingDivergedError
from attnkit.train.head_alignment import MapsReport, write_maps
from attnkit.train.task_model import ModelConfig, TaskModel
from attnkit.train.tasks import IGNORE, Accuracy, Task, accuracy_from_predictions, make_task

__all__ = [
    "FitSummary",
    "Progress",
    "RunOptions",
    "TrainConfig",
    "TrainResult",
    "TrainingDivergedError",
    "build",
    "evaluate",
    "fit",
    "held_out_set",
    "lr_at",
    "resume_config",
    "train",
    "train_batch",
]

_EVAL, _TEST, _STEP = 1, 2, 3  # streams of the data generators
_EVAL_CHUNK = 2048  # sequences per forward pass in evaluation
_FLOAT32_MAX = torch.finfo(torch.float32).max
_MAX_LR = _FLOAT32_MAX / 10  # AdamW's first step, lr / (1 - beta1), must fit in float32


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a training run (runtime choices such as threads, device and the
    number of processes are arguments of :func:`train`).

    >>> TrainConfig().resolved().length
    16
    """

    task: str = "reverse"  # reverse, sort or kv_recall (attnkit.train.tasks)
    length: int | None = None  # T; None = the task's default
    vocab: int | None = None  # the task's vocabulary knob; None = the task's default
    steps: int = 2000  # the most optimizer steps; the run stops earlier at `target`
    batch_size: int = 128  # B, sequences per step over all processes
    lr: float = 3e-3  # peak learning rate of AdamW
    warmup: int = 50  # linear warm-up steps, then cosine decay to lr / 10 at `steps`
    weight_decay: float = 0.01
    clip: float | None = 1.0  # clip the gradient norm to this; None = no clipping
    dim: int = 64  # E
    num_layers: int = 2
    num_heads: int = 4
    seed: int = 0
    eval_every: int = 25  # evaluate the held-out eval set every this many steps
    eval_size: int = 1000  # held-out sequences checked for the early stop
    test_size: int = 10_000  # held-out sequences of the final report (another draw)
    target: float | None = 0.995  # stop once the eval set's sequence accuracy reaches this
    checkpoint_every: int = 100  # also at the end, at the early stop and when interrupted

    def __post_init__(self) -> None:
        positive = ("steps", "batch_size", "dim", "num_layers", "num_heads", "eval_every")
        for name in (*positive, "eval_size", "test_size", "checkpoint_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise guards.config_error(name, value, "a positive int")
        seeds = "an int in [0, 2**64)"  # torch.manual_seed's range
        for name, what, most in (("warmup", "an int >= 0", math.inf), ("seed", seeds, 2**64 - 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
                raise guards.config_error(name, value, what)
        if not isinstance(self.task, str):
            raise guards.config_error("task", self.task, "a task's name: reverse, sort, kv_recall")
        num, lr, clip, wd = guards.is_number, self.lr, self.clip, self.weight_decay
        if not (num(lr) and 0 < lr <= _MAX_LR):
            raise guards.config_error("lr", lr, "a float > 0 and <= 3.4e37")
        if clip is not None and not (num(clip) and clip > 0):
            raise guards.config_error("clip", clip, "a float > 0, or None")
        if not (num(wd) and 0 <= lr * wd <= _FLOAT32_MAX):
            raise guards.config_error(
                "weight_decay", wd, "a float >= 0 (lr x weight_decay <= 3.4e38)"
            )
        if self.target is not None and not (num(self.target) and 0 < self.target <= 1):
            raise guards.config_error("target", self.target, "a fraction in (0, 1], or None")
        if self.dim % self.num_heads:
            raise guards.config_error("num_heads", self.num_heads, f"a divisor of dim={self.dim}")

    def resolved(self) -> TrainConfig:
        """The same config with the task's sizes filled in (and checked)."""
        task = make_task(self.task, length=self.length, vocab=self.vocab)
        return replace(self, length=task.length, vocab=task.vocab)

    def make_task(self) -> Task:
        return make_task(self.task, length=self.length, vocab=self.vocab)

    def model_config(self) -> ModelConfig:
        task = self.make_task()
        return derive_config(
            ModelConfig,
            self,
            vocab_size=task.vocab_size,
            num_classes=task.num_classes,
            max_length=task.length,
        )


@dataclass(frozen=True)
class Progress:
    """One report from the loop after each step; ``held_out`` only after an evaluation.

    ``loss`` is the mean training loss of the step over the global batch (``None`` in the first
    report, made before any step); ``seconds`` the time this call has trained.
    """

    step: int
    total: int
    loss: float | None
    held_out: Accuracy | None
    seconds: float


@dataclass(frozen=True)
class FitSummary:
    """How the training part of a call went."""

    start_step: int  # > 0 when resumed
    step: int  # optimizer steps done, in all
    finished: bool  # the run is over: target reached or all steps done
    reached_target: bool
    stopped: bool  # interrupted (Ctrl-C or stop_at) with a checkpoint; --resume continues
    held_out: Accuracy | None  # the last evaluation on the eval set
    seconds: float


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


# ---------------------------------------------------------------------------------------------
# the pieces


def lr_at(config: TrainConfig, step: int) -> float:
    """The learning rate of step ``step`` (0-based): linear warm-up, then cosine to ``lr / 10``.

    >>> c = TrainConfig(lr=1.0, warmup=10, steps=110)
    >>> lr_at(c, 0), lr_at(c, 9), lr_at(c, 60), lr_at(c, 110)
    (0.1, 1.0, 0.55, 0.1)
    """
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    span = max(config.steps - config.warmup, 1)
    progress = min((step - config.warmup) / span, 1.0)
    return config.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _generator(seed: int, stream: int, index: int = 0) -> torch.Generator:
    """A generator for one draw: ``stream`` (eval, test or a step) and its ``index``."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + stream) * 1_000_033 + index) % 2**63)


def train_batch(
    config: TrainConfig, task: Task, step: int, *, rank: int = 0, world_size: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard of the training batch of step ``step``: ``x, y (B / N, T)``."""
    x, y = task.draw(_generator(config.seed, _STEP, step), config.batch_size, held_out=False)
    shard = config.batch_size // world_size
    return x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]


def held_out_set(
    config: TrainConfig, task: Task, *, test: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out eval set (``test=False``) or test set: ``x, y (n, T)``."""
    stream, n = (_TEST, config.test_size) if test else (_EVAL, config.eval_size)
    return task.draw(_generator(config.seed, stream), n, held_out=True)


def build(
    config: TrainConfig, device: torch.device | str = "cpu"
) -> tuple[Task, TaskModel, torch.optim.AdamW]:
    """The task, the model (initialised from ``config.seed``; the caller's RNG is left alone)
    and its AdamW optimizer."""
    task = config.make_task()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = TaskModel(config.model_config())
    model.to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )
    return task, model, optimizer


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Accuracy:
    """Exact accuracy of ``model`` (a :class:`TaskModel`) on ``x, y (n, T)``."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    preds = [
        model(x[i : i + _EVAL_CHUNK].to(device)).logits.argmax(dim=-1).cpu()  # (chunk, T)
        for i in range(0, x.shape[0], _EVAL_CHUNK)
    ]
    model.train(was_training)
    return accuracy_from_predictions(torch.cat(preds), y)


def resume_config(out: str | os.PathLike[str]) -> TrainConfig:
    """The config of the run whose checkpoint is in ``out`` (what ``--resume`` continues)."""
    info = read_info(Path(out) / CHECKPOINT_NAME)
    try:
        config = TrainConfig(**info.config)
        config.resolved()
        guards.check_complete(info.config, config)
    except (AttentionInputError, TypeError, ValueError) as e:
        raise guards.saved_config_error(info.path, e) from None
    if info.step > config.steps:
        past = ValueError(f"step {info.step} is past the run's {config.steps} steps")
        raise guards.saved_config_error(info.path, past)
    return config


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# the loop


def fit(
    config: TrainConfig,
    out: Path,
    *,
    resume: bool,
    rank: int,
    world_size: int,
    device: torch.device,
    stop_at: int | None,
    emit: Callable[[Progress], None],
    should_stop: Callable[[], bool],
) -> FitSummary:
    """Train one rank of a run (the whole run when ``world_size == 1``).

    Rank 0 evaluates, decides the early stop, writes the checkpoints and calls ``emit``;
    ``should_stop`` is asked after every step (Ctrl-C in a one-process run). With
    ``world_size > 1`` the process group must be initialised (see :mod:`attnkit.train.ddp`).
    """
    import torch.distributed as dist

    task, model, optimizer = build(config, device)
    path = out / CHECKPOINT_NAME
    step, finished = 0, False
    if resume:
        info = load_checkpoint(path, model, optimizer)
        step, finished = info.step, info.finished
    start = step
    net: nn.Module = model
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
    lead = rank == 0
    eval_x, eval_y = held_out_set(config, task, test=False)  # only rank 0 evaluates
    held_out: Accuracy | None = None
    reached = stopped = False
    t0 = time.perf_counter()
    if lead:
        emit(Progress(step, config.steps, None, None, 0.0))

    saved = step if resume else None  # the step of this run's last checkpoint

    def save() -> None:  # on every rank: the ranks hold the same weights and stop together
        nonlocal saved
        bad = guards.first_non_finite(model)
        if bad is not None:
            what = f"parameter {bad} became NaN or infinite"
            raise TrainingDivergedError(
                guards.diverged(what, step, config.steps, out, saved), step, saved
            )
        if lead:
            try:
                save_checkpoint(
                    path, model, optimizer, step=step, finished=finished, config=asdict(config)
                )
            except WriteError as e:  # a full disk: one line, the last checkpoint intact
                raise guards.save_failed(e, out, saved) from e
        saved = step

    if finished and lead:  # a finished run resumed: nothing to train, report where it stands
        held_out = evaluate(model, eval_x, eval_y)
        reached = config.target is not None and held_out.sequence >= config.target
    model.train()
    while not finished and step < config.steps:
        x, y = train_batch(config, task, step, rank=rank, world_size=world_size)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(config, step)
        logits = net(x.to(device)).logits  # (B/N, T, C)
        loss = F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), ignore_index=IGNORE)
        shown = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(shown)
            shown /= world_size
        if not bool(torch.isfinite(shown)):  # the same verdict on every rank: stop, take no step
            what = f"the training loss is {float(shown)}"
            message = guards.diverged(what, step + 1, config.steps, out, saved)
            raise TrainingDivergedError(message, step + 1, saved)
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)  # DDP averages the gradients over the ranks here
        if config.clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), config.clip)
        optimizer.step()
        step += 1
        evaluated = step % config.eval_every == 0 or step == config.steps
        if evaluated:
            flag = torch.zeros(1)
            if lead:
                held_out = evaluate(model, eval_x, eval_y)
                flag[0] = float(config.target is not None and held_out.sequence >= config.target)
            if world_size > 1:
                dist.broadcast(flag, src=0)
            reached = bool(flag.item())
        finished = reached or step == config.steps
        stopped = not finished and ((stop_at is not None and step >= stop_at) or should_stop())
        if lead:
            seconds = time.perf_counter() - t0
            shown_acc = held_out if evaluated else None
            emit(Progress(step, config.steps, float(shown.item()), shown_acc, seconds))
        if finished or stopped or step % config.checkpoint_every == 0:
            save()
        if stopped:
            break
    seconds = time.perf_counter() - t0
    return FitSummary(start, step, finished, reached, stopped, held_out, seconds)


@dataclass(frozen=True)
class RunOptions:
    """How :func:`train` runs a config (every keyword of :func:`train` but ``progress``)."""

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
        config = config.resolved()
        device = guards.check_device(self.device, self.world_size)
        guards.check_world(config.batch_size, self.world_size)
        guards.check_memory(config, device, self.world_size)  # before anything is allocated
        threads, stop_at = self.threads, self.stop_at
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise guards.config_error("threads", threads, "a positive int")
        if stop_at is not None and (not isinstance(stop_at, int) or stop_at < 1):
            raise guards.config_error("stop_at", stop_at, "a positive int, or None")
        path = guards.check_out(out, resume=self.resume, overwrite=self.overwrite)
        if self.resume:
            guards.check_same_run(config, resume_config(path), path)
            verify_checkpoint(path / CHECKPOINT_NAME)  # every tensor finite
        return config


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
) -> TrainResult:
    """Train a :class:`TaskModel` on ``config.task``; checkpoint, test and write maps to ``out``.

    - ``resume``: continue the run whose checkpoint is in ``out`` (``config`` must be its config,
      see :func:`resume_config`).
    - ``overwrite``: start a new run in an ``out`` that holds another run's checkpoint, which
      the new run's first checkpoint replaces. Without it (or ``resume``) that is refused.
    - ``world_size``: the number of processes (DistributedDataParallel over gloo, CPU).
    - ``threads``: torch threads per process. One is the default: on these small matrices a
      second thread costs more in synchronisation than it gains, many times over when the CPU is
      shared.
    - ``stop_at``: stop after this step with a checkpoint, as if interrupted.
    - ``progress``: called with a :class:`Progress` after each step (in this process).

    After the fit (unless it stopped early), the trained model is checked on ``test_size``
    fresh held-out sequences and the attention maps of one of them are written to ``out``
    (``attention.html``, ``.png``, ``.npz``; see :func:`attnkit.train.head_alignment.write_maps`).

    Raises :class:`~attnkit.train.guards.TrainingDivergedError` at the first non-finite loss,
    before that step is taken; the checkpoint in ``out`` is then the run's last good one.
    """
    t0 = time.perf_counter()
    options = RunOptions(resume, overwrite, world_size, device, threads, stop_at)
    config = options.check(config, out)
    out = Path(out)
    dev = torch.device(device)
    out.mkdir(parents=True, exist_ok=True)
    emit = progress or (lambda p: None)
    with _threads(threads):
        if world_size == 1:
            with guards.sigint_stops() as should_stop:
                summary = fit(
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
            from attnkit.train.ddp import spawn

            summary = spawn(config, out, options, emit)
        test = maps = None
        if not summary.stopped:
            task, model, _ = build(config, dev)
            load_checkpoint(out / CHECKPOINT_NAME, model)
            test_x, test_y = held_out_set(config, task, test=True)
            test = evaluate(model, test_x, test_y)
            maps = write_maps(task, model, test_x[0], out)  # the first test sequence
    seconds = time.perf_counter() - t0
    return TrainResult(config, summary, test, maps, out / CHECKPOINT_NAME, world_size, seconds)
