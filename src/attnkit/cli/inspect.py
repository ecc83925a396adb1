"""``attnkit show`` and ``attnkit trace``: look inside, from the shell (``doctor``: cli/doctor.py).

The commands are thin: :func:`attnkit.inspect.show.show_text` does the work of ``show``
(:func:`attnkit.inspect.show_hf.show_model` that of ``show --model DIR``); the modules and
:func:`attnkit.trace` that of ``trace``. Only typer and attnkit's own modules are imported at the
top; the tokenizer, the weights, transformers, matplotlib and rich load when a command runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import torch
import typer

import attnkit
from attnkit.cli.app import command
from attnkit.errors import AttentionInputError
from attnkit.inspect.show import DEFAULT_TEXT, STEPS, ShowResult, show_text

__all__ = ["print_show", "run_show", "show", "trace"]

DEFAULT_OUT = Path("attnkit-out")

OutOption = Annotated[
    Path,
    typer.Option(
        "--out", help="Directory for attention.html, .png and .npz (created when missing)."
    ),
]


# ---------------------------------------------------------------------------------------------
# show


@contextmanager
def _progress(total: int) -> Iterator[Callable[[str], None]]:
    """A step reporter on stderr: a live rich progress bar on a terminal, plain lines elsewhere."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    console = Console(stderr=True, highlight=False)
    if not console.is_terminal:  # CI, pipes, files: no live display, one line per step
        count = iter(range(1, total + 1))
        yield lambda step: console.print(f"attnkit: [{next(count)}/{total}] {step}", markup=False)
        return
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("starting", total=total)
        started = False

        def step(name: str) -> None:
            nonlocal started
            if started:
                progress.advance(task)
            started = True
            progress.update(task, description=name)

        yield step
        progress.update(task, completed=total)


def print_show(result: ShowResult) -> None:
    """Print what ``show`` found: tokens, one layer's trace, one head's summary, the files."""
    echo = typer.echo
    T = len(result.tokens)
    cut = f" (truncated from {result.truncation.total})" if result.truncation else ""
    flat = " ".join(result.text.split())  # one line, whatever whitespace the text holds
    echo(f'attnkit show: "{flat[:80]}"' + ("…" if len(flat) > 80 else ""))
    echo(
        f"  {result.model}: {result.num_layers} layers x {result.num_heads} heads; "
        f"{T} tokens{cut}: {' '.join(result.tokens[:24])}" + (" …" if T > 24 else "")
    )
    if result.backends:
        kinds = ", ".join(sorted(set(result.backends)))
        echo(f"  ran on attnkit: {len(result.backends)} attention calls (backend {kinds})")
    echo("")
    echo(f"shape trace of layer {result.layer}'s attention call ({result.layer_name}):")
    echo(result.trace)
    echo("")
    echo(f"layer {result.layer}, head {result.head}: the token each token attends to most")
    w, iw = max(len(t) for t in result.tokens), len(str(T - 1))
    for r in result.top:
        query, key = f"{r.query_index:>{iw}} {r.query:<{w}}", f"{r.key_index:>{iw}} {r.key:<{w}}"
        echo(f"  {query}  ->  {key}  {r.weight:.4f}")
    echo("")
    att = tuple(result.attentions.shape)
    what = {
        "html": "explore every head: open it in a browser",
        "png": f"all {result.num_layers} x {result.num_heads} maps in one image",
        "npz": f"attentions {att} float32, tokens ({T},), hidden {tuple(result.hidden.shape)}",
    }
    paths = {kind: str(p.resolve()) for kind, p in result.paths.items()}
    width = max(len(p) for p in paths.values())
    echo("wrote:")
    for kind, path in paths.items():
        echo(f"  {path:<{width}}  {what[kind]}")


def run_show(
    text: str, out: Path, *, truncate: bool, layer: int, head: int, model: Path | None = None
) -> ShowResult:
    """Run :func:`~attnkit.inspect.show.show_text` (or, with ``model``, a checkpoint directory:
    :func:`~attnkit.inspect.show_hf.show_model`) with progress on stderr, then print it."""
    with _progress(len(STEPS)) as step:
        if model is None:
            result = show_text(text, out, truncate=truncate, layer=layer, head=head, progress=step)
        else:
            from attnkit.inspect.show_hf import show_model

            result = show_model(
                model, text, out, truncate=truncate, layer=layer, head=head, progress=step
            )
    if result.truncation is not None:
        typer.echo(f"attnkit: note: {result.truncation.describe()}", err=True)
    print_show(result)
    return result


@command()
def show(
    text: Annotated[
        str,
        typer.Argument(
            metavar="TEXT", help="The text to look at (at most the model's positions: 512)."
        ),
    ] = DEFAULT_TEXT,
    out: OutOption = DEFAULT_OUT,
    truncate: Annotated[
        bool,
        typer.Option(
            "--truncate", help="Keep the first 512 tokens (the model's positions) of a longer text."
        ),
    ] = False,
    layer: Annotated[int, typer.Option(help="The layer whose shape trace is printed.")] = 0,
    head: Annotated[int, typer.Option(help="The head of that layer to sum up.")] = 0,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            metavar="DIR",
            show_default="all-MiniLM-L6-v2",
            help="A local transformers checkpoint directory (config.json, safetensors, "
            "tokenizer; encoder or decoder), run on attnkit.",
        ),
    ] = None,
) -> None:
    """Run all-MiniLM-L6-v2 (or --model DIR) on TEXT; write its attention maps (HTML, PNG, NPZ)."""
    run_show(text, out, truncate=truncate, layer=layer, head=head, model=model)


# ---------------------------------------------------------------------------------------------
# trace


def _flag_error(
    flag: str, value: int, problem: str, expected: str, fix: str
) -> AttentionInputError:
    return AttentionInputError(
        "attnkit trace", flag, problem, got=f"{flag} {value}", expected=expected, fix=fix
    )


TRACE_MAX_GIB = 2  # the most memory a trace may take: its shapes do not depend on the sizes


def _trace_gib(batch: int, seq: int, d_model: int, heads: int, source: int) -> float:
    """An upper bound on the float32 memory of a trace: the four projections (E x E), the
    activations (B, L or S, E) and, twice, the scores ``(B, H, L, S)``."""
    E, B, L, S = d_model, batch, seq, source
    return 4 * (4 * E * E + 4 * B * L * E + 3 * B * S * E + 2 * B * heads * L * S) / 2**30


def _divisors(n: int, limit: int = 64) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _check_trace_sizes(sizes: dict[str, int], heads: int, kv_heads: int, d_model: int) -> None:
    for flag, value in sizes.items():
        least = 0 if flag == "--cross-len" else 1
        if value < least:
            raise _flag_error(
                flag,
                value,
                f"{flag} must be {'>= 0' if least == 0 else 'positive'}, got {value}.",
                f"{flag} >= {least}",
                "pass --cross-len 0 for self-attention, or a context length"
                if least == 0
                else f"pass {flag} 1 or more",
            )
    if d_model % heads:
        raise _flag_error(
            "--d-model",
            d_model,
            f"--d-model {d_model} is not divisible by --heads {heads} "
            "(each head gets d-model / heads dims).",
            "d_model % heads == 0",
            f"choose --heads from {_divisors(d_model)}",
        )
    if heads % kv_heads:
        raise _flag_error(
            "--kv-heads",
            kv_heads,
            f"--heads {heads} is not divisible by --kv-heads {kv_heads} "
            "(each key/value head serves heads / kv-heads query heads).",
            "heads % kv_heads == 0",
            f"choose --kv-heads from {_divisors(heads)}",
        )
    source = sizes["--cross-len"] or sizes["--seq"]
    gib = _trace_gib(sizes["--batch"], sizes["--seq"], d_model, heads, source)
    if gib > TRACE_MAX_GIB:
        given = " ".join(f"{k} {v}" for k, v in sizes.items() if k != "--kv-heads")
        raise AttentionInputError(
            "attnkit trace",
            "sizes",
            f"{given} would take about {gib:,.1f} GiB (projections E x E, scores "
            f"B x H x L x S), more than the {TRACE_MAX_GIB} GiB a trace may use.",
            got=given,
            expected=f"sizes whose trace fits in {TRACE_MAX_GIB} GiB",
            fix="trace smaller sizes: the steps and their named shapes are the same "
            "(e.g. --seq 64 --cross-len 0)",
        )


@command()
def trace(
    batch: Annotated[int, typer.Option(help="B, the batch size.")] = 2,
    seq: Annotated[int, typer.Option(help="L, the query length.")] = 6,
    d_model: Annotated[int, typer.Option(help="E, the model width.")] = 512,
    heads: Annotated[int, typer.Option(help="H, the query heads.")] = 8,
    kv_heads: Annotated[
        int | None,
        typer.Option(
            metavar="HEADS",
            show_default="--heads",
            help="Hkv, key/value heads; fewer than --heads is grouped-query.",
        ),
    ] = None,
    cross_len: Annotated[
        int, typer.Option(help="S > 0: cross-attend to a context of this length.")
    ] = 0,
    causal: Annotated[bool, typer.Option("--causal", help="Apply the causal mask.")] = False,
) -> None:
    """Print the shape of every step of one MultiHeadAttention call."""
    kv = heads if kv_heads is None else kv_heads
    sizes = {"--batch": batch, "--seq": seq, "--d-model": d_model, "--heads": heads}
    sizes |= {"--kv-heads": kv, "--cross-len": cross_len}
    _check_trace_sizes(sizes, heads, kv, d_model)

    kind = "multi-head" if kv == heads else ("multi-query" if kv == 1 else "grouped-query")
    attending = f"cross-attention over S={cross_len}" if cross_len else "self-attention"
    typer.echo(
        f"attnkit trace: batch={batch} seq={seq} d_model={d_model} heads={heads} "
        f"kv_heads={kv} head_dim={d_model // heads} cross_len={cross_len} causal={causal} "
        f"({kind} {attending})"
    )
    mha = attnkit.MultiHeadAttention(d_model, heads, num_kv_heads=kv, causal=causal)
    x = torch.randn(batch, seq, d_model)  # (B, L, E)
    context = torch.randn(batch, cross_len, d_model) if cross_len else None  # (B, S, E)
    with torch.inference_mode(), attnkit.trace() as t:
        mha(x, context)
    typer.echo(t.render())
