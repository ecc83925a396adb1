"""``attnkit train``: train a small attnkit transformer end to end, then write its attention maps.

The command is thin: :func:`attnkit.train.train` does the work, after
:meth:`attnkit.train.RunOptions.check` has checked every option: a bad one, an unusable ``--out`` or
an ``--out`` that holds a run (without ``--resume`` or ``--overwrite``) ends the command with
one line and exit code 2 before any work. Only typer is imported at the top; torch, the
training package, rich and matplotlib load when the command runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from attnkit.cli.app import command

if TYPE_CHECKING:
    from attnkit.train import Progress, TrainConfig, TrainResult

__all__ = ["train"]

DEFAULT_OUT = Path("attnkit-train")
EXIT_INTERRUPTED = 130  # the shell's code for Ctrl-C
EXIT_FAILED = 1


def _percent(x: float) -> str:
    return f"{100 * x:.2f}%"


@contextmanager
def _progress_bar(task: str) -> Iterator[Callable[[Progress], None]]:
    """A live rich bar with the loss on a terminal; one line per evaluation elsewhere."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    console = Console(stderr=True, highlight=False)
    if not console.is_terminal:  # CI, pipes, files: no live display

        def line(p: Progress) -> None:
            if p.held_out is not None and p.loss is not None:
                console.print(
                    f"attnkit: step {p.step}/{p.total}  loss {p.loss:.4f}  held-out "
                    f"{_percent(p.held_out.sequence)} of sequences right  {p.seconds:.1f} s",
                    markup=False,
                )

        yield line
        return
    columns = (
        TextColumn(f"train {task}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}  held-out {task.fields[acc]}"),
        TimeElapsedColumn(),
    )
    with Bar(*columns, console=console, transient=False) as bar:
        handle = bar.add_task("train", total=None, loss="-", acc="-")

        def update(p: Progress) -> None:
            fields: dict[str, Any] = {}
            if p.loss is not None:
                fields["loss"] = f"{p.loss:.4f}"
            if p.held_out is not None:
                fields["acc"] = _percent(p.held_out.sequence)
            bar.update(handle, total=p.total, completed=p.step, **fields)

        yield update


def _header(config: TrainConfig, world_size: int, threads: int, device: str) -> str:
    import torch

    from attnkit.train import TaskModel
    from attnkit.train.tasks import HOLDOUT_EVERY

    task = config.make_task()
    with torch.device("meta"):  # sizes only: no memory, no random numbers drawn
        params = sum(p.numel() for p in TaskModel(config.model_config()).parameters())
    procs = f"{world_size} processes (DDP, gloo)" if world_size > 1 else "1 process"
    return "\n".join(
        [
            f"attnkit train: {task.name} ({task.summary}), T={task.length}, vocab {task.vocab}",
            f"  model: {config.num_layers} layers x {config.num_heads} heads, width {config.dim}, "
            f"{params:,} parameters (attnkit TransformerStack, pre-norm, bidirectional)",
            f"  AdamW lr {config.lr:g}, batch {config.batch_size}, at most {config.steps} steps, "
            f"stops once {_percent(config.target or 1.0)} of {config.eval_size} held-out "
            "sequences are right; "
            f"{procs}, {threads} torch thread{'s' if threads > 1 else ''}"
            f"{' each' if world_size > 1 else ''}, {device}",
            f"  held-out split: 1 sequence in {HOLDOUT_EVERY} (by a hash of its tokens), never "
            "trained on",
        ]
    )


def _report(result: TrainResult, seconds: float) -> None:
    """Print what the run did; ``seconds``: the whole command's time."""
    echo = typer.echo
    fit, test, maps = result.fit, result.test, result.maps
    if fit.start_step == fit.step:
        echo(f"the run was already finished at step {fit.step}: nothing to train")
    else:
        resumed = f" (resumed at step {fit.start_step})" if fit.start_step else ""
        echo(f"trained {fit.step} steps{resumed} in {fit.seconds:.1f} s")
    if test is None or maps is None:
        return
    echo(
        f"held-out test: {_percent(test.sequence)} of {test.size} sequences fully right, "
        f"{100 * test.token:.3f}% of tokens"
    )
    echo("one held-out sequence:")
    echo(f"  input       {' '.join(maps.tokens)}")
    echo(f"  target      {maps.target}")
    echo(f"  prediction  {maps.prediction}   ({'right' if maps.correct else 'wrong'})")
    best = maps.best
    echo(
        f"attention: layer {best.layer} head {best.head} puts its largest weight on "
        f"{maps.alignment_name} in {best.hits} of {best.rows} query rows "
        f"(mean weight there {best.mass:.2f})"
    )
    layer = maps.best_layer
    echo(
        f"           layer {layer.layer}, its heads averaged: {layer.hits} of {layer.rows} rows "
        f"(mean weight there {layer.mass:.2f})"
    )
    what = {
        "html": "explore every head: open it in a browser",
        "png": "all layers x heads in one image",
        "npz": "the weights (N, H, T, T), tokens, hidden state",
    }
    paths = {"checkpoint": result.checkpoint} | maps.paths
    shown = {k: str(p.resolve()) for k, p in paths.items()}
    width = max(len(p) for p in shown.values())
    echo("wrote:")
    echo(f"  {shown.pop('checkpoint'):<{width}}  model + AdamW state at step {fit.step}")
    for kind, path in shown.items():
        echo(f"  {path:<{width}}  {what[kind]}")
    verdict = "reached" if fit.reached_target else "ended with"
    echo(
        f"attnkit train: {result.config.task} {verdict} {_percent(test.sequence)} held-out "
        f"sequence accuracy (tokens {100 * test.token:.3f}%) in {fit.step} steps, "
        f"{seconds:.1f} s in all"
    )


@contextmanager
def _one_line_warnings() -> Iterator[None]:
    """A checkpoint without checksums (an older attnkit's) is said once, on one line:
    ``attnkit: warning: ...``; other warnings are shown as Python shows them."""
    import warnings

    from attnkit.train.checkpoint import UncheckedCheckpointWarning

    shown: set[str] = set()
    with warnings.catch_warnings():
        previous = warnings.showwarning

        def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
            if not issubclass(category, UncheckedCheckpointWarning):
                previous(message, category, *args, **kwargs)
                return
            text = " ".join(str(message).split())
            if text not in shown:
                shown.add(text)
                typer.echo(f"attnkit: warning: {text}", err=True)

        warnings.showwarning = show
        warnings.simplefilter("always", UncheckedCheckpointWarning)
        yield


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was given on the command line (not left at its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"


@command()
def train(
    ctx: typer.Context,
    task: Annotated[str, typer.Option(help="reverse, sort or kv_recall.")] = "reverse",
    steps: Annotated[
        int, typer.Option(help="The most training steps; the run stops earlier once accurate.")
    ] = 2000,
    out: Annotated[
        str,
        typer.Option(
            metavar="<dir>",
            help="Directory for the checkpoint and the attention maps; one that holds a run "
            "needs --resume or --overwrite.",
        ),
    ] = str(DEFAULT_OUT),
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue the run whose checkpoint is in --out (its task, steps and seed).",
        ),
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite", help="Start a new run in an --out that holds a run, replacing it."
        ),
    ] = False,
    ddp: Annotated[
        int,
        typer.Option(
            help="Train with this many processes (DistributedDataParallel, gloo); at most one "
            "per CPU core."
        ),
    ] = 1,
    seed: Annotated[int, typer.Option(help="Seeds the model and the data.")] = 0,
    device: Annotated[str, typer.Option(help="cpu, or cuda where there is one.")] = "cpu",
    threads: Annotated[int, typer.Option(help="torch threads per process.")] = 1,
) -> None:
    """Train a small transformer on a task that needs attention; write its attention maps."""
    import time
    from dataclasses import asdict, replace

    started = time.perf_counter()

    from attnkit.train import (
        CHECKPOINT_NAME,
        DistributedTrainingError,
        RunOptions,
        TrainConfig,
        TrainingDivergedError,
        resume_config,
    )
    from attnkit.train import train as run
    from attnkit.train.guards import check_out

    with _one_line_warnings():  # an old checkpoint (no checksums): one line, once
        path = check_out(out, resume=resume, overwrite=overwrite)
        asked: dict[str, Any] = {"task": task, "steps": steps, "seed": seed}
        if resume:  # the checkpoint's settings, except those given on the command line
            given = {k: v for k, v in asked.items() if _given(ctx, k)}
            config = replace(resume_config(path), **given)
        else:
            config = TrainConfig(**asked).resolved()
        options = RunOptions(resume, overwrite, world_size=ddp, device=device, threads=threads)
        config = options.check(config, path)  # all of it checked before the header
        if overwrite and (path / CHECKPOINT_NAME).exists():
            typer.echo(
                f"attnkit: note: --overwrite: this new run's first checkpoint replaces the one in "
                f"{path}",
                err=True,
            )
        typer.echo(_header(config, ddp, threads, device))
        try:
            with _progress_bar(config.task) as progress:
                result = run(config, path, progress=progress, **asdict(options))
        except (DistributedTrainingError, TrainingDivergedError) as e:
            typer.echo(f"attnkit: error: {e}", err=True)
            raise typer.Exit(EXIT_FAILED) from None
        _report(result, time.perf_counter() - started)
        if result.fit.stopped:
            typer.echo(
                f"attnkit train: stopped at step {result.fit.step} of {result.config.steps}, "
                f"checkpoint saved; continue with: attnkit train --resume --out {path}"
            )
            raise typer.Exit(EXIT_INTERRUPTED)
