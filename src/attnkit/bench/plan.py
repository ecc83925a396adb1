"""Which rows ``attnkit bench`` runs, with which peers, and the checks of its options.

A row is ``(workload, L, dtype, mode)``. Named sets of rows (:data:`GROUPS`, ``-g/--group``):
``acceptance`` (the suite's own acceptance rows and a few more) and ``issue14`` (the rows issue
14, one kernel for every mask, is judged on); a run with no selection runs both, each row once
(:data:`DEFAULT_ROWS`). Each row has its own default peers (:func:`row_peers`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

from attnkit.bench.peers import PEERS
from attnkit.bench.workloads import WORKLOADS, get_workload
from attnkit.errors import AttentionInputError

__all__ = [
    "ACCEPTANCE_ROWS",
    "DEFAULT_PEERS",
    "DEFAULT_ROWS",
    "DTYPES",
    "FULL_LENGTHS",
    "GROUPS",
    "ISSUE14_ROWS",
    "MAX_GEMM",
    "MAX_LENGTH",
    "MODES",
    "QUICK_PEERS",
    "QUICK_ROWS",
    "check_options",
    "check_rows",
    "plan_rows",
    "row_peers",
]

#: the suite's own acceptance rows (its first issue's) and a few more
ACCEPTANCE_ROWS: list[tuple[str, int, str, str]] = [
    ("dense", 4096, "float32", "fwd"),
    ("causal", 4096, "float32", "fwd"),
    ("window", 16384, "float32", "fwd"),
    ("window", 16384, "float32", "fwd+bwd"),
    ("document", 16384, "float32", "fwd"),
    ("padding", 8192, "float32", "fwd"),
    ("prefix", 4096, "float32", "fwd"),
    ("gqa", 4096, "float32", "fwd"),
    ("decode", 65536, "float32", "fwd"),
    ("window", 4096, "bfloat16", "fwd"),
    ("window", 65536, "float32", "fwd+bwd"),
]
#: the rows issue 14 (one kernel for every mask) is judged on; the first five are shared with
#: :data:`ACCEPTANCE_ROWS` (same row, same peers), the others are new: 8 equal documents,
#: grouped-query 32/8 heads with a causal window at 16k, and bfloat16 against attnkit's own
#: float32 on the same call (the ``attnkit-fp32`` peer) and against SDPA in bfloat16
ISSUE14_ROWS: list[tuple[str, int, str, str]] = [
    ("causal", 4096, "float32", "fwd"),
    ("document", 16384, "float32", "fwd"),
    ("padding", 8192, "float32", "fwd"),
    ("prefix", 4096, "float32", "fwd"),
    ("window", 4096, "bfloat16", "fwd"),
    ("document-equal", 16384, "float32", "fwd"),
    ("gqa-window", 16384, "float32", "fwd"),
    ("gqa-window", 16384, "float32", "fwd+bwd"),
    ("window", 4096, "bfloat16", "fwd+bwd"),
    ("causal", 4096, "bfloat16", "fwd"),
]
#: the rows of a run with no selection: both groups, each row once
DEFAULT_ROWS: list[tuple[str, int, str, str]] = list(dict.fromkeys(ACCEPTANCE_ROWS + ISSUE14_ROWS))
#: named sets of rows (``-g/--group``)
GROUPS: dict[str, list[tuple[str, int, str, str]]] = {
    "acceptance": ACCEPTANCE_ROWS,
    "issue14": ISSUE14_ROWS,
}
DEFAULT_PEERS = ["naive", "sdpa", "flex", "attnkit", "attnkit-blocked"]
#: the seed-style code takes minutes a call on big rows: with the default peers it runs only
#: where B x H x L x S is at most this (8 heads at L = 4096), in float32
NAIVE_MAX = 8 * 4096 * 4096
FULL_LENGTHS = [1024, 4096, 16384, 65536]
QUICK_ROWS: list[tuple[str, int, str, str]] = [
    ("dense", 512, "float32", "fwd"),
    ("window", 2048, "float32", "fwd"),
    ("window", 2048, "float32", "fwd+bwd"),
]
QUICK_PEERS = ["naive", "sdpa", "attnkit", "attnkit-blocked"]
DTYPES = ["float32", "bfloat16"]
MODES = ["fwd", "fwd+bwd"]
#: the longest length a row may ask for: 4x the longest --full length (the inputs alone grow
#: with L, and planning a row builds its block map)
MAX_LENGTH = 4 * FULL_LENGTHS[-1]
#: the largest n of the n x n GEMM timed beside the peers (its three matrices take 3 GiB)
MAX_GEMM = 16384
MAX_MIN_CALL_MS = 10_000.0  # --min-call-ms at most (10 s of calls per peer and round)


def _option_error(
    where: str, flag: str, problem: str, got: str, expected: str, fix: str
) -> AttentionInputError:
    return AttentionInputError(
        where, flag, f"{flag} {problem}", got=got, expected=expected, fix=fix
    )


def _check_names(where: str, flag: str, given: Iterable[str], allowed: list[str]) -> None:
    for name in given:
        if name not in allowed:
            listed = ", ".join(allowed)
            raise _option_error(
                where,
                flag,
                f"{name!r} is not one of {listed}.",
                f"{flag} {name}",
                f"one of {listed}",
                f"pick from {listed} (repeat {flag.split('/')[0]} for several)",
            )


def _check_lengths(where: str, lengths: Iterable[int]) -> None:
    for L in lengths:
        if isinstance(L, bool) or not isinstance(L, int) or not 1 <= L <= MAX_LENGTH:
            raise _option_error(
                where,
                "-L/--length",
                f"{L!r} is not a length attnkit bench runs: it takes 1 to {MAX_LENGTH}.",
                f"-L {L}",
                f"an int from 1 to {MAX_LENGTH}",
                f"pass lengths such as {', '.join(f'-L {n}' for n in FULL_LENGTHS)}",
            )


def check_rows(rows: Iterable[tuple[str, int, str, str]], where: str = "attnkit.bench") -> None:
    """Refuse a row whose workload, length, dtype or mode :func:`run` does not know."""
    for workload, L, dtype, mode in rows:
        _check_names(where, "-w/--workload", [workload], list(WORKLOADS))
        _check_lengths(where, [L])
        _check_names(where, "--dtype", [dtype], DTYPES)
        _check_names(where, "--mode", [mode], MODES)


def check_options(
    *,
    peers: list[str] | None = None,
    reps: int = 5,
    cap_gib: float = 12.0,
    gemm_n: int = 4096,
    min_call_ms: float = 50.0,
    where: str = "attnkit.bench.run",
) -> None:
    """Refuse the options of :func:`run` that it cannot use (before it measures anything).

    >>> check_options(gemm_n=-1)
    Traceback (most recent call last):
    attnkit.errors.AttentionInputError: attnkit.bench.run: --gemm-size -1 is not a GEMM size:...
    """
    _check_names(where, "-p/--peer", peers or [], list(PEERS))
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise _option_error(
            where,
            "--reps",
            f"must be a positive int, got {reps!r}.",
            f"--reps {reps}",
            "an int >= 1 (5 or more for published numbers)",
            "pass --reps 5",
        )
    if not (isinstance(cap_gib, (int, float)) and math.isfinite(cap_gib) and cap_gib > 0):
        raise _option_error(
            where,
            "--cap-gib",
            f"must be a positive number of GiB, got {cap_gib!r}.",
            f"--cap-gib {cap_gib}",
            "a finite number > 0",
            "pass --cap-gib 12 (the default)",
        )
    if isinstance(gemm_n, bool) or not isinstance(gemm_n, int) or not 0 <= gemm_n <= MAX_GEMM:
        raise _option_error(
            where,
            "--gemm-size",
            f"{gemm_n!r} is not a GEMM size: 0 (none) or an n from 1 to {MAX_GEMM}.",
            f"--gemm-size {gemm_n}",
            f"an int from 0 to {MAX_GEMM}",
            "pass --gemm-size 4096 (the default), or 0 for none",
        )
    ok = isinstance(min_call_ms, (int, float)) and not isinstance(min_call_ms, bool)
    if not (ok and math.isfinite(min_call_ms) and 0 <= min_call_ms <= MAX_MIN_CALL_MS):
        raise _option_error(
            where,
            "--min-call-ms",
            f"{min_call_ms!r} is not a time per round: 0 (one call per round) or up to "
            f"{MAX_MIN_CALL_MS:g} ms.",
            f"--min-call-ms {min_call_ms}",
            f"a number of ms from 0 to {MAX_MIN_CALL_MS:g}",
            "pass --min-call-ms 50 (the default), or 0 for one call per round",
        )


def plan_rows(
    rows: Iterable[tuple[str, int, str, str]] | None = None,
    *,
    workloads: list[str] | None = None,
    lengths: list[int] | None = None,
    dtypes: list[str] | None = None,
    modes: list[str] | None = None,
    full: bool = False,
    quick: bool = False,
    groups: list[str] | None = None,
) -> list[tuple[str, int, str, str]]:
    """The rows to run: given ones, the default rows (every group's, each once), the rows of
    the named ``groups`` (:data:`GROUPS`: ``acceptance``, ``issue14``), the quick smoke rows,
    or the product of the selections (``full``: every workload, length, dtype and mode).

    ``dtypes`` and ``modes`` filter any of these; ``quick`` and ``groups`` are their own
    choice of rows, so each is refused together with ``workloads``, ``lengths``, ``full`` or
    the other. Unknown names, lengths outside ``1..MAX_LENGTH`` and a selection that leaves no
    rows are refused too (:class:`~attnkit.AttentionInputError`).

    >>> plan_rows(quick=True, modes=["fwd+bwd"])
    [('window', 2048, 'float32', 'fwd+bwd')]
    >>> plan_rows(groups=["issue14"], dtypes=["bfloat16"])[-1]
    ('causal', 4096, 'bfloat16', 'fwd')
    """
    where = "attnkit.bench.plan_rows"
    if rows is not None:
        chosen = list(rows)
        check_rows(chosen, where)
        return chosen
    _check_names(where, "-w/--workload", workloads or [], list(WORKLOADS))
    _check_lengths(where, lengths or [])
    _check_names(where, "--dtype", dtypes or [], DTYPES)
    _check_names(where, "--mode", modes or [], MODES)
    _check_names(where, "-g/--group", groups or [], list(GROUPS))
    for flag, own, what in (
        ("--quick", quick, "its own rows (dense L=512, window L=2048)"),
        ("-g/--group", bool(groups), "the rows of its group"),
    ):
        others = [
            ("--full", full),
            ("-w/--workload", bool(workloads)),
            ("-L/--length", bool(lengths)),
            ("--quick", quick),
            ("-g/--group", bool(groups)),
        ]
        other = next((name for name, on in others if on and name != flag), None)
        if own and other is not None:
            raise _option_error(
                where,
                flag,
                f"picks {what}, so it cannot go with {other}.",
                f"{flag} with {other}",
                f"{flag} alone (--dtype, --mode and -p still apply), or rows chosen without it",
                f"leave out {flag}, or leave out {other}",
            )
    if full or workloads or lengths:
        base = list(
            itertools.product(
                workloads or list(WORKLOADS),
                lengths or FULL_LENGTHS,
                dtypes or DTYPES,
                modes or MODES,
            )
        )
    else:
        base = QUICK_ROWS if quick else DEFAULT_ROWS
    if groups:
        base = list(dict.fromkeys(r for g in groups for r in GROUPS[g]))
    chosen = [
        r
        for r in base
        if (not workloads or r[0] in workloads)
        and (not lengths or r[1] in lengths)
        and (not dtypes or r[2] in dtypes)
        and (not modes or r[3] in modes)
    ]
    if not chosen:
        which = "quick" if quick else f"{'/'.join(groups)} group" if groups else "default"
        kinds = sorted({f"{r[2]} {r[3]}" for r in base})
        raise _option_error(
            where,
            "--dtype/--mode",
            f"leave no rows to run: the {which} rows are {', '.join(kinds)}.",
            f"--dtype {dtypes or DTYPES} --mode {modes or MODES}",
            "a selection that keeps at least one row",
            "pick rows with -w and -L to run other dtypes and modes",
        )
    return chosen


def row_peers(workload: str, L: int, dtype: str) -> list[str]:
    """The peers a row runs when none are named: the workload's own (:attr:`Workload.peers`,
    module rows: the two modules) or sdpa, flex, attnkit (auto) and attnkit-blocked; naive
    on float32 rows up to 8 heads at L = 4096; attnkit-fp32 on rows that are not float32.

    >>> row_peers("window", 4096, "bfloat16")
    ['sdpa', 'flex', 'attnkit', 'attnkit-blocked', 'attnkit-fp32']
    >>> row_peers("gqa-window", 16384, "float32")
    ['flex', 'attnkit']
    """
    wl = get_workload(workload)
    if wl.module:
        return ["torch-mha", "attnkit-mha"]
    names = list(wl.peers) if wl.peers is not None else list(DEFAULT_PEERS)
    Lq, S = wl.sizes(L)
    if wl.B * wl.H * Lq * S > NAIVE_MAX or dtype != "float32":
        names = [p for p in names if p != "naive"]
    if dtype != "float32":
        names.append("attnkit-fp32")
    return names
