"""``attnkit bench``: attnkit against torch's own attention, in one run, as ratios.

Every option and output path is checked before anything is measured: a bad one ends the
command with one line and exit code 2 (see :mod:`attnkit.cli.app`), never after a run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnkit.cli.app import check_output_file, command
from attnkit.errors import AttentionInputError
from attnkit.files import WriteError

MIN_REPS = 5  # the fewest timed calls whose median the command publishes


def _check_outputs(outputs: dict[str, Path | None]) -> None:
    """Each output file writable, no two the same, the plot a PNG."""
    seen: dict[Path, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        check_output_file("attnkit bench", flag, path)
        if flag == "--plot" and path.suffix.lower() != ".png":
            raise AttentionInputError(
                "attnkit bench",
                flag,
                f"--plot {path}: the plot is a PNG, so its name must end in .png.",
                got=f"--plot {path}",
                expected="a path ending in .png",
                fix=f"pass --plot {path.with_suffix('.png')}",
            )
        same = seen.setdefault(path.resolve(), flag)
        if same != flag:
            raise AttentionInputError(
                "attnkit bench",
                flag,
                f"{same} and {flag} both name {path}: one would overwrite the other.",
                got=f"{same} {path} {flag} {path}",
                expected="a different file for each output",
                fix=f"give {flag} another name",
            )


def _check_reps(reps: int) -> None:
    if reps < MIN_REPS:
        raise AttentionInputError(
            "attnkit bench",
            "--reps",
            f"--reps must be at least {MIN_REPS} (the table shows the median), got {reps}.",
            got=f"--reps {reps}",
            expected=f"an int >= {MIN_REPS}",
            fix=f"pass --reps {MIN_REPS} or more",
        )


@command()
def bench(
    workload: Annotated[
        list[str] | None,
        typer.Option(
            "--workload",
            "-w",
            metavar="<workload>",
            help="dense, causal, padding, window, document, document-equal, "
            "prefix, gqa, gqa-window, decode, module (repeat for several)",
        ),
    ] = None,
    length: Annotated[
        list[int] | None,
        typer.Option(
            "--length", "-L", metavar="<int>", help="sequence lengths, 1 to 262144 (repeat)"
        ),
    ] = None,
    dtype: Annotated[
        list[str] | None,
        typer.Option("--dtype", metavar="<dtype>", help="float32 and/or bfloat16 (repeat)"),
    ] = None,
    mode: Annotated[
        list[str] | None,
        typer.Option("--mode", metavar="<mode>", help="fwd and/or fwd+bwd (repeat)"),
    ] = None,
    peer: Annotated[
        list[str] | None,
        typer.Option(
            "--peer",
            "-p",
            metavar="<peer>",
            help="naive, sdpa, flex, torch-mha, attnkit, "
            "attnkit-<backend>, attnkit-mha (repeat; default: the main ones)",
        ),
    ] = None,
    group: Annotated[
        list[str] | None,
        typer.Option(
            "--group",
            "-g",
            metavar="<group>",
            help="only the rows of a group: acceptance (the suite's own), issue14 (one kernel "
            "for every mask) (repeat; not with -w, -L, --full or --quick)",
        ),
    ] = None,
    reps: Annotated[int, typer.Option(help="timed calls per peer (median; >= 5)")] = MIN_REPS,
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help="a smoke run of about a minute: dense 512 and window 2048, four peers "
            "(not with -w, -L or --full; --dtype, --mode and -p still apply)",
        ),
    ] = False,
    full: Annotated[
        bool,
        typer.Option(
            "--full", help="every workload, length (1k-64k), dtype, mode and peer (hours)"
        ),
    ] = False,
    memory: Annotated[
        bool, typer.Option(help="measure peak memory (a fresh process per case)")
    ] = True,
    cap_gib: Annotated[
        float, typer.Option(help="skip peers whose dense tensors would need more (GiB, > 0)")
    ] = 12.0,
    gemm_size: Annotated[
        int,
        typer.Option(help="n of the n x n fp32 GEMM timed in every round (0: none; <= 16384)"),
    ] = 4096,
    min_call_ms: Annotated[
        float,
        typer.Option(
            help="a peer's call faster than this is repeated within each round to fill it, and "
            "the round takes the mean (at most 16 calls; 0: one call per round)"
        ),
    ] = 50.0,
    json_out: Annotated[Path | None, typer.Option("--json", help="write JSON here")] = None,
    markdown: Annotated[Path | None, typer.Option(help="write a markdown report here")] = None,
    plot: Annotated[Path | None, typer.Option(help="write a PNG plot here (.png)")] = None,
    device: Annotated[
        str,
        typer.Option(
            metavar="<device>",
            help="cpu, or cuda: SDPA, flex and attnkit on the GPU in TFLOP/s and its bf16 GEMM "
            "peak (docs/cuda.md)",
        ),
    ] = "cpu",
) -> None:
    """Time attnkit against SDPA, flex_attention, the seed code and nn.MultiheadAttention.

    With no options: the rows of both groups (acceptance: dense/causal 4k, sliding window 16k
    forward and backward, 8 documents 16k, key padding 8k, and a few more; issue14: equal
    documents 16k, grouped-query 32/8 window 16k forward and backward, bfloat16 against
    attnkit's float32 and SDPA), about 13 to 21 minutes on a quiet 2-core machine
    (docs/benchmarks.md).
    """
    if device != "cpu":  # the CUDA bench: attnkit.bench.cuda
        from attnkit.bench import cuda_options as cuda

        _check_reps(reps)
        _check_outputs({"--json": json_out, "--markdown": markdown, "--plot": plot})
        unsupported = {"--plot": plot is not None, "--quick": quick, "--full": full}
        unsupported["--no-memory"] = not memory
        cuda.main(
            device=device, workloads=workload, lengths=length, dtypes=dtype, modes=mode,
            peers=peer, reps=reps, cap_gib=cap_gib, json_out=json_out, markdown=markdown,
            unsupported=unsupported, echo=typer.echo,
        )  # fmt: skip
        return

    from attnkit import bench as api
    from attnkit.bench.peers import PEERS
    from attnkit.bench.plan import QUICK_PEERS

    # every check first: nothing is measured until all options and paths are good
    rows = api.plan_rows(
        workloads=workload,
        lengths=length,
        dtypes=dtype,
        modes=mode,
        full=full,
        quick=quick,
        groups=group,
    )
    _check_reps(reps)
    peers = peer or (list(PEERS) if full else QUICK_PEERS if quick else None)
    api.check_options(
        peers=peers,
        reps=reps,
        cap_gib=cap_gib,
        gemm_n=gemm_size,
        min_call_ms=min_call_ms,
        where="attnkit bench",
    )
    _check_outputs({"--json": json_out, "--markdown": markdown, "--plot": plot})

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

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
            min_call_ms=min_call_ms,
        )
    api.print_table(result)
    writers = ((json_out, "--json", api.write_json), (markdown, "--markdown", api.write_markdown))
    for path, flag, write in (*writers, (plot, "--plot", api.write_plot)):
        if path is not None:
            try:  # each file replaced whole, never through a link (attnkit.files)
                write(result, path)
            except WriteError as e:  # a full disk: one line; the table above is the result
                raise e.at("attnkit bench", flag) from e.__cause__
    for path in (json_out, markdown, plot):
        if path is not None:
            typer.echo(f"wrote {path}")
