"""The options of ``attnkit bench --device cuda`` and the command itself: every option is
checked, then the GPU (:func:`attnkit.bench.cuda.require_cuda`), then the run.

The measurement is in :mod:`attnkit.bench.cuda`; the CLI (``attnkit.cli.bench``) hands any
``--device`` but ``cpu`` to :func:`main`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from attnkit import files
from attnkit.bench.cuda import (
    CUDA_PEERS,
    CUDA_ROWS,
    CUDA_WORKLOADS,
    WHERE,
    require_cuda,
    run_cuda,
    to_markdown,
    write_json,
)
from attnkit.errors import AttentionInputError

__all__ = ["check_peers", "main", "plan_cuda_rows"]


DTYPES = ("float32", "bfloat16", "float16")
MODES = ("fwd", "fwd+bwd")


def _bad(flag: str, got: str, expected: str, fix: str) -> AttentionInputError:
    problem = f"{flag} {got} is not one the CUDA bench runs (expected {expected})."
    return AttentionInputError(
        WHERE, flag, problem, got=f"{flag} {got}", expected=expected, fix=fix
    )


def plan_cuda_rows(
    workloads: Sequence[str] | None,
    lengths: Sequence[int] | None,
    dtypes: Sequence[str] | None,
    modes: Sequence[str] | None,
) -> list[tuple[str, int, str, str]]:
    """The rows asked for (each option's default: issue 16's value), checked; none given:
    :data:`CUDA_ROWS`."""
    if not (workloads or lengths or dtypes or modes):
        return list(CUDA_ROWS)
    for flag, given, allowed in (
        ("--workload", workloads or [], CUDA_WORKLOADS),
        ("--dtype", dtypes or [], DTYPES),
        ("--mode", modes or [], MODES),
    ):
        for x in given:
            if x not in allowed:
                raise _bad(flag, x, f"one of {', '.join(allowed)}", f"pass {flag} {allowed[0]}")
    for n in lengths or []:
        if not 128 <= n <= 262144:
            raise _bad("--length", str(n), "an int from 128 to 262144", "pass --length 16384")
    return [
        (w, n, d, m)
        for w in workloads or ["window", "document"]
        for n in lengths or [16384]
        for d in dtypes or ["bfloat16"]
        for m in modes or list(MODES)
    ]


def check_peers(peers: Sequence[str] | None) -> list[str]:
    """The peers asked for (default :data:`CUDA_PEERS`), checked."""
    from attnkit.backends import available_backends

    allowed = [*CUDA_PEERS, *(f"attnkit-{b}" for b in available_backends())]
    for p in peers or []:
        if p not in allowed:
            raise _bad("--peer", p, f"one of {', '.join(allowed)}", "pass --peer attnkit")
    return list(peers or CUDA_PEERS)


def main(
    *,
    device: str,
    workloads: Sequence[str] | None,
    lengths: Sequence[int] | None,
    dtypes: Sequence[str] | None,
    modes: Sequence[str] | None,
    peers: Sequence[str] | None,
    reps: int,
    cap_gib: float,
    json_out: Path | None,
    markdown: Path | None,
    unsupported: dict[str, bool],
    echo: Callable[[str], None],
) -> None:
    """``attnkit bench --device <device>`` (any device but ``cpu``): every option checked,
    then the GPU, then the run; ``unsupported`` holds the CPU bench's options given that this
    one does not take (``--plot``, ``--quick``, ...)."""
    if device != "cuda":
        raise _bad("--device", device, "cpu (the default) or cuda", "pass --device cuda")
    for flag, given in unsupported.items():
        if given:
            raise AttentionInputError(
                WHERE, flag, f"{flag} belongs to the CPU bench; the CUDA bench does not take it.",
                got=f"--device cuda {flag}", expected="--device cuda without " + flag,
                fix=f"leave out {flag} (or --device cuda for the CPU bench)",
            )  # fmt: skip
    rows = plan_cuda_rows(workloads, lengths, dtypes, modes)
    chosen = check_peers(peers)
    require_cuda()
    result = run_cuda(
        rows, peers=chosen, reps=reps, cap_gib=cap_gib,
        progress=lambda label, i, n: echo(f"[{i + 1}/{n}] {label}"),
    )  # fmt: skip
    table = to_markdown(result)
    echo(table)
    if json_out is not None:
        try:
            write_json(result, json_out)
        except files.WriteError as e:
            raise e.at(WHERE, "--json") from e.__cause__
        echo(f"wrote {json_out}")
    if markdown is not None:
        files.write_text(markdown, table + "\n", where=WHERE, argument="--markdown")
        echo(f"wrote {markdown}")
