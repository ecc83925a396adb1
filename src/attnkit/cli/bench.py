"""``attnkit bench``: attnkit against torch's own attention, in one run, as ratios."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnkit.cli.app import command

ListOption = Annotated[list[str] | None, typer.Option()]


@command()
def bench(
    workload: Annotated[
        list[str] | None,
        typer.Option(
            "--workload",
            "-w",
            help="dense, causal, padding, window, document, "
            "prefix, gqa, decode, module (repeat for several)",
        ),
    ] = None,
    length: Annotated[
        list[int] | None, typer.Option("--length", "-L", help="sequence lengths (repeat)")
    ] = None,
    dtype: Annotated[
        list[str] | None, typer.Option("--dtype", help="float32 and/or bfloat16 (repeat)")
    ] = None,
    mode: Annotated[
        list[str] | None, typer.Option("--mode", help="fwd and/or fwd+bwd (repeat)")
    ] = None,
    peer: Annotated[
        list[str] | None,
        typer.Option(
            "--peer",
            "-p",
            help="naive, sdpa, flex, torch-mha, attnkit, "
            "attnkit-<backend>, attnkit-mha (repeat; default: the main ones)",
        ),
    ] = None,
    reps: Annotated[int, typer.Option(help="timed calls per peer (median; >= 5)", min=5)] = 5,
    quick: Annotated[bool, typer.Option(help="a small smoke run (seconds to a minute)")] = False,
    full: Annotated[
        bool, typer.Option(help="every workload, length (1k-64k), dtype, mode and peer")
    ] = False,
    memory: Annotated[
        bool, typer.Option(help="measure peak memory (a fresh process per case)")
    ] = True,
    cap_gib: Annotated[
        float, typer.Option(help="skip peers whose dense tensors would need more (GiB)")
    ] = 12.0,
    gemm_size: Annotated[
        int, typer.Option(help="n of the n x n fp32 GEMM timed in every round (0: none)")
    ] = 4096,
    json_out: Annotated[Path | None, typer.Option("--json", help="write JSON here")] = None,
    markdown: Annotated[Path | None, typer.Option(help="write a markdown report here")] = None,
    plot: Annotated[Path | None, typer.Option(help="write a PNG plot here")] = None,
) -> None:
    """Time attnkit against SDPA, flex_attention, the seed code and nn.MultiheadAttention.

    With no options: the acceptance rows (dense/causal 4k, sliding window 16k forward and
    backward, 8 documents 16k, key padding 8k, and a few more), about 10-15 minutes here.
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from attnkit import bench as api
    from attnkit.bench.peers import PEERS

    rows = api.plan_rows(
        workloads=workload, lengths=length, dtypes=dtype, modes=mode, full=full, quick=quick
    )
    if not rows:
        raise typer.BadParameter("the selection leaves no rows to run")
    peers = peer or (list(PEERS) if full else None)
    if quick and not peer:
        peers = ["naive", "sdpa", "attnkit", "attnkit-blocked"]
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task("attnkit bench", total=None)

        def progress(label: str, done: int, total: int) -> None:
            bar.update(task, description=label[:70], completed=done, total=total)

        result = api.run(
            rows,
            peers=peers,
            reps=reps,
            memory=memory,
            cap_gib=cap_gib,
            progress=progress,
            gemm_n=gemm_size,
        )
    api.print_table(result)
    if json_out is not None:
        api.write_json(result, json_out)
    if markdown is not None:
        api.write_markdown(result, markdown)
    if plot is not None:
        api.write_plot(result, plot)
    for path in (json_out, markdown, plot):
        if path is not None:
            typer.echo(f"wrote {path}")
