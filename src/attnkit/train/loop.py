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
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from attnkit.configs import derive_config
from attnkit.errors import AttentionInputError
from attnkit.train.checkpoint import CHECKPOINT_NAME, load_checkpoint, read_info, save_checkpoint
from attnkit.train.head_alignment import MapsReport, write_maps
from attnkit.train.task_model import ModelConfig, TaskModel
from attnkit.train.tasks import IGNORE, Accuracy, Task, accuracy_from_predictions, make_task

__all__ = [
    "FitSummary",
    "Progress",
    "TrainConfig",
    "TrainResult",
    "build",
    "check_run",
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
                raise _config_error(name, value, "a positive int")
        for name in ("warmup", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise _config_error(name, value, "an int >= 0")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise _config_error("lr", self.lr, "a float > 0")
        if self.clip is not None and not (isinstance(self.clip, (int, float)) and self.clip > 0):
            raise _config_error("clip", self.clip, "a float > 0, or None")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            raise _config_error("weight_decay", self.weight_decay, "a float >= 0")
        if self.target is not None and not 0 < self.target <= 1:
            raise _config_error("target", self.target, "a fraction in (0, 1], or None")
        if self.dim % self.num_heads:
            raise _config_error("num_heads", self.num_heads, f"a divisor of dim={self.dim}")

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


def _config_error(name: str, value: object, expected: str) -> AttentionInputError:
    flag = "--" + name.replace("_", "-")
    return AttentionInputError(
        "attnkit.train.TrainConfig",
        name,
        f"{flag} must be {expected}, got {value!r}.",
        got=f"{name}={value!r}",
        expected=expected,
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
    return TrainConfig(**info.config)


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _sigint_stops() -> Iterator[Callable[[], bool]]:
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

    def save() -> None:
        if lead:
            save_checkpoint(
                path, model, optimizer, step=step, finished=finished, config=asdict(config)
            )

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
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)  # DDP averages the gradients over the ranks here
        if config.clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), config.clip)
        optimizer.step()
        step += 1
        shown = loss.detach()
        if world_size > 1:
            dist.all_reduce(shown)
            shown /= world_size
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


def _check_resume(config: TrainConfig, out: Path) -> None:
    saved = resume_config(out)
    for f in fields(TrainConfig):
        ours, theirs = getattr(config, f.name), getattr(saved, f.name)
        if ours != theirs:
            flag = "--" + f.name.replace("_", "-")
            raise AttentionInputError(
                "attnkit train",
                f.name,
                f"--resume continues the run in {out}, which has {f.name}={theirs!r}, "
                f"but {f.name}={ours!r} was asked for.",
                got=f"{f.name}={ours!r}",
                expected=f"{f.name}={theirs!r} (the checkpoint's)",
                fix=f"leave out {flag}, or start a new run without --resume",
            )


def _check_device(device: str, world_size: int) -> torch.device:
    def bad(problem: str, fix: str) -> AttentionInputError:
        return AttentionInputError(
            "attnkit train", "device", problem, got=f"device={device!r}", expected="cpu", fix=fix
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


def _check_world(config: TrainConfig, world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise AttentionInputError(
            "attnkit train",
            "ddp",
            f"--ddp must be a positive number of processes, got {world_size!r}.",
            got=f"ddp={world_size!r}",
            expected="an int >= 1",
            fix="--ddp 2 trains with two processes",
        )
    if config.batch_size % world_size:
        raise AttentionInputError(
            "attnkit train",
            "ddp",
            f"--ddp {world_size} does not divide the batch of {config.batch_size} sequences "
            "into equal shards.",
            got=f"batch_size={config.batch_size}, ddp={world_size}",
            expected="batch_size % ddp == 0",
            fix=f"use --ddp {' or '.join(str(n) for n in (2, 4, 8) if config.batch_size % n == 0)}",
        )


def check_run(
    config: TrainConfig,
    out: str | os.PathLike[str],
    *,
    resume: bool = False,
    world_size: int = 1,
    device: str = "cpu",
    threads: int = 1,
    stop_at: int | None = None,
) -> TrainConfig:
    """Check the arguments of :func:`train` without training; return the resolved config.

    Raises :class:`~attnkit.AttentionInputError` for what :func:`train` would refuse.
    """
    config = config.resolved()
    _check_device(device, world_size)
    _check_world(config, world_size)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise _config_error("threads", threads, "a positive int")
    if stop_at is not None and (not isinstance(stop_at, int) or stop_at < 1):
        raise _config_error("stop_at", stop_at, "a positive int, or None")
    if resume:
        _check_resume(config, Path(out))
    return config


def train(
    config: TrainConfig,
    out: str | os.PathLike[str],
    *,
    resume: bool = False,
    world_size: int = 1,
    device: str = "cpu",
    threads: int = 1,
    stop_at: int | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> TrainResult:
    """Train a :class:`TaskModel` on ``config.task``; checkpoint, test and write maps to ``out``.

    - ``resume``: continue the run whose checkpoint is in ``out`` (``config`` must be its config,
      see :func:`resume_config`).
    - ``world_size``: the number of processes (DistributedDataParallel over gloo, CPU).
    - ``threads``: torch threads per process. One is the default: on these small matrices a
      second thread costs more in synchronisation than it gains, many times over when the CPU is
      shared.
    - ``stop_at``: stop after this step with a checkpoint, as if interrupted.
    - ``progress``: called with a :class:`Progress` after each step (in this process).

    After the fit (unless it stopped early), the trained model is checked on ``test_size``
    fresh held-out sequences and the attention maps of one of them are written to ``out``
    (``attention.html``, ``.png``, ``.npz``; see :func:`attnkit.train.head_alignment.write_maps`).
    """
    t0 = time.perf_counter()
    config = check_run(
        config,
        out,
        resume=resume,
        world_size=world_size,
        device=device,
        threads=threads,
        stop_at=stop_at,
    )
    out = Path(out)
    dev = torch.device(device)
    out.mkdir(parents=True, exist_ok=True)
    emit = progress or (lambda p: None)
    with _threads(threads):
        if world_size == 1:
            with _sigint_stops() as should_stop:
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

            summary = spawn(config, out, resume, world_size, threads, stop_at, emit)
        test = maps = None
        if not summary.stopped:
            task, model, _ = build(config, dev)
            load_checkpoint(out / CHECKPOINT_NAME, model)
            test_x, test_y = held_out_set(config, task, test=True)
            test = evaluate(model, test_x, test_y)
            maps = write_maps(task, model, test_x[0], out)  # the first test sequence
    seconds = time.perf_counter() - t0
    return TrainResult(config, summary, test, maps, out / CHECKPOINT_NAME, world_size, seconds)
