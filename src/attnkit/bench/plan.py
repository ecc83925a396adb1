"""Which rows ``attnkit bench`` runs, with which peers, and the checks of its options: on the
CPU and on the GPU (``--device cuda``).

A row is ``(workload, L, dtype, mode)``. Named sets of rows (:data:`GROUPS`, ``-g/--group``):
``acceptance`` (the suite's own acceptance rows and a few more), ``masks`` (every mask kind
through one kernel, and bfloat16 against float32) and ``decode`` (decoding against a KV cache,
and a dense prefill; :data:`DECODE_ROWS`); a run with no selection runs the first two, each row
once (:data:`DEFAULT_ROWS`). Each row has its own default peers (:func:`row_peers`).

The GPU bench takes the same rows: :func:`plan_cuda_rows` picks them (default
:data:`CUDA_ROWS`), :func:`check_cuda_rows` and :func:`check_cuda_peers` refuse what it does not
run, each in its own words (``--workload decode is not one the CUDA bench runs``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

from attnkit.bench.peers import PEERS
from attnkit.bench.workloads import WORKLOADS, get_workload
from attnkit.errors import AttentionInputError

__all__ = [
    "ACCEPTANCE_ROWS",
    "CUDA_DTYPES",
    "CUDA_PEERS",
    "CUDA_ROWS",
    "CUDA_WHERE",
    "CUDA_WORKLOADS",
    "DECODE_ROWS",
    "DEFAULT_PEERS",
    "DEFAULT_ROWS",
    "DTYPES",
    "FULL_LENGTHS",
    "GROUPS",
    "MASKS_ROWS",
    "MAX_GEMM",
    "MAX_LENGTH",
    "MODES",
    "QUICK_PEERS",
    "QUICK_ROWS",
    "check_cuda_command",
    "check_cuda_peers",
    "check_cuda_rows",
    "check_options",
    "check_rows",
    "plan_cuda_rows",
    "plan_rows",
    "row_peers",
]

#: the ``acceptance`` group: the suite's own acceptance rows and a few more
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
#: the ``masks`` group: every mask kind through one kernel, at a fraction of the GEMM (causal,
#: 8 documents of random and of equal lengths, key padding, prefix-LM, grouped-query 32/8 heads
#: with a causal window), and bfloat16 against attnkit's own float32 on the same call (the
#: ``attnkit-fp32`` peer) and against SDPA in bfloat16; the first five rows are also
#: :data:`ACCEPTANCE_ROWS`' (same row, same peers)
MASKS_ROWS: list[tuple[str, int, str, str]] = [
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
#: the ``decode`` group (``-g decode``, not in the default run): a decode step (1 query, GQA
#: 32/8 heads of 128, 4096 cached keys; float32 and bfloat16), 8 sequences with ragged cache
#: lengths up to 2048, a 4096 window over a 16384 cache, a dense prefill (16 heads of 64, 4096),
#: and the decode step at 64 cached keys (where the per-call overhead shows); the workloads
#: carry their peers (SDPA, attnkit, onnxruntime's GroupQueryAttention where installed)
DECODE_ROWS: list[tuple[str, int, str, str]] = [
    ("decode-gqa", 4096, "float32", "fwd"),
    ("decode-gqa", 4096, "bfloat16", "fwd"),
    ("decode-ragged", 2048, "float32", "fwd"),
    ("decode-window", 16384, "float32", "fwd"),
    ("prefill-dense", 4096, "float32", "fwd"),
    ("decode-gqa", 64, "float32", "fwd"),
]
#: the ``bf16`` group (``-g bf16``, not in the default run): bfloat16 at model
#: sizes against SDPA and compiled flex in bfloat16 and attnkit's own float32: dense 16 heads of
#: 64 at 4096, causal GQA 32/8 of 128 at 4096, a causal window of 1024 with GQA 8/2 of 128 at
#: 8192, a decode step (GQA 32/8 of 128, 4096 keys), causal 16x64 at 4096 and a window of 1024
#: (8 heads) at 8192 forward + backward
BF16_ROWS: list[tuple[str, int, str, str]] = [
    ("prefill-dense", 4096, "bfloat16", "fwd"),
    ("gqa-128", 4096, "bfloat16", "fwd"),
    ("gqa-window-1024", 8192, "bfloat16", "fwd"),
    ("decode-gqa", 4096, "bfloat16", "fwd"),
    ("causal-16x64", 4096, "bfloat16", "fwd+bwd"),
    ("window-1024", 8192, "bfloat16", "fwd+bwd"),
]
#: the rows of a run with no selection: the acceptance and masks groups, each row once
DEFAULT_ROWS: list[tuple[str, int, str, str]] = list(dict.fromkeys(ACCEPTANCE_ROWS + MASKS_ROWS))
#: named sets of rows (``-g/--group``)
GROUPS: dict[str, list[tuple[str, int, str, str]]] = {
    "acceptance": ACCEPTANCE_ROWS,
    "masks": MASKS_ROWS,
    "decode": DECODE_ROWS,
    "bf16": BF16_ROWS,
}
DEFAULT_PEERS = ["naive", "sdpa", "flex", "attnkit", "attnkit-blocked"]
#: the seed-style code builds the whole (B, H, L, S) scores: with the default peers it runs
#: only where B x H x L x S is at most this (8 heads at L = 4096), in float32
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


def _check_exclusive(
    where: str,
    full: bool,
    workloads: list[str] | None,
    lengths: list[int] | None,
    quick: bool,
    groups: list[str] | None,
) -> None:
    """``--quick`` and ``-g/--group`` pick their own rows: each alone, without ``--full``,
    ``-w`` or ``-L``."""
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
    the named ``groups`` (:data:`GROUPS`: ``acceptance``, ``masks``), the quick smoke rows,
    or the product of the selections (``full``: every workload, length, dtype and mode).

    ``dtypes`` and ``modes`` filter any of these; ``quick`` and ``groups`` are their own
    choice of rows, so each is refused together with ``workloads``, ``lengths``, ``full`` or
    the other. Unknown names, lengths outside ``1..MAX_LENGTH`` and a selection that leaves no
    rows are refused too (:class:`~attnkit.AttentionInputError`).

    >>> plan_rows(quick=True, modes=["fwd+bwd"])
    [('window', 2048, 'float32', 'fwd+bwd')]
    >>> plan_rows(groups=["masks"], dtypes=["bfloat16"])[-1]
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
    _check_exclusive(where, full, workloads, lengths, quick, groups)
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


# ---------------------------------------------------------------------------------------------
# the GPU bench (``--device cuda``): the same rows, its own workloads, dtypes, lengths and peers

CUDA_WHERE = "attnkit bench --device cuda"
CUDA_PEERS = ["sdpa", "flex", "attnkit"]
CUDA_WORKLOADS = ["dense", "causal", "window", "document", "padding", "prefix", "gqa"]
CUDA_DTYPES = ["float32", "bfloat16", "float16"]
CUDA_LENGTHS = (128, 262144)  #: the shortest and the longest length it runs
#: its default rows (bf16 unless said): window and 8 documents at 16k and 32k, forward and
#: forward + backward; causal 16k both; dense 16k; grouped-query 32/8 16k in bf16 and fp32
CUDA_ROWS: list[tuple[str, int, str, str]] = [
    (w, L, "bfloat16", m)
    for w in ("window", "document")
    for L in (16384, 32768)
    for m in ("fwd", "fwd+bwd")
] + [
    ("causal", 16384, "bfloat16", "fwd"),
    ("causal", 16384, "bfloat16", "fwd+bwd"),
    ("dense", 16384, "bfloat16", "fwd"),
    ("gqa", 16384, "bfloat16", "fwd"),
    ("gqa", 16384, "float32", "fwd"),
]


def _cuda_error(flag: str, got: str, expected: str, fix: str) -> AttentionInputError:
    problem = f"{flag} {got} is not one the CUDA bench runs (expected {expected})."
    return AttentionInputError(
        CUDA_WHERE, flag, problem, got=f"{flag} {got}", expected=expected, fix=fix
    )


def _check_cuda(flag: str, given: Iterable[str | int]) -> None:
    """Each of ``given`` one the GPU bench runs for ``flag`` (``--length``: in
    :data:`CUDA_LENGTHS`)."""
    lo, hi = CUDA_LENGTHS
    allowed = {"--workload": CUDA_WORKLOADS, "--dtype": CUDA_DTYPES, "--mode": MODES}
    for x in given:
        if flag == "--length":
            if not (isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi):
                raise _cuda_error(flag, str(x), f"an int from {lo} to {hi}", "pass --length 16384")
        elif x not in allowed[flag]:
            names = allowed[flag]
            raise _cuda_error(flag, str(x), f"one of {', '.join(names)}", f"pass {flag} {names[0]}")


def check_cuda_rows(rows: Iterable[tuple[str, int, str, str]]) -> None:
    """Refuse a row the GPU bench does not run (its workload, length, dtype or mode)."""
    for workload, L, dtype, mode in rows:
        for flag, value in (("--workload", workload), ("--dtype", dtype), ("--mode", mode)):
            _check_cuda(flag, [value])
        _check_cuda("--length", [L])


def plan_cuda_rows(
    workloads: Sequence[str] | None = None,
    lengths: Sequence[int] | None = None,
    dtypes: Sequence[str] | None = None,
    modes: Sequence[str] | None = None,
) -> list[tuple[str, int, str, str]]:
    """The GPU bench's rows: none asked for, :data:`CUDA_ROWS`; else the product of the
    selections, each checked (an option not given: window and document, 16384, bfloat16,
    both modes).

    >>> plan_cuda_rows(lengths=[2048], modes=["fwd"])
    [('window', 2048, 'bfloat16', 'fwd'), ('document', 2048, 'bfloat16', 'fwd')]
    """
    if not (workloads or lengths or dtypes or modes):
        return list(CUDA_ROWS)
    _check_cuda("--workload", workloads or [])
    _check_cuda("--dtype", dtypes or [])
    _check_cuda("--mode", modes or [])
    _check_cuda("--length", lengths or [])
    return [
        (w, n, d, m)
        for w in workloads or ["window", "document"]
        for n in lengths or [16384]
        for d in dtypes or ["bfloat16"]
        for m in modes or list(MODES)
    ]


def check_cuda_peers(peers: Sequence[str] | None) -> list[str]:
    """The GPU bench's peers asked for (default :data:`CUDA_PEERS`), checked: its peers and
    ``attnkit-<backend>`` for each registered backend."""
    from attnkit.backends import available_backends

    allowed = [*CUDA_PEERS, *(f"attnkit-{b}" for b in available_backends())]
    for p in peers or []:
        if p not in allowed:
            raise _cuda_error("--peer", p, f"one of {', '.join(allowed)}", "pass --peer attnkit")
    return list(peers or CUDA_PEERS)


def check_cuda_command(device: str, unsupported: dict[str, bool]) -> None:
    """``--device`` names the GPU bench (``cuda``), and no option of the CPU bench's own is
    given (``unsupported``: each such flag and whether it was given)."""
    if device != "cuda":
        raise _cuda_error("--device", device, "cpu (the default) or cuda", "pass --device cuda")
    for flag, given in unsupported.items():
        if given:
            raise AttentionInputError(
                CUDA_WHERE,
                flag,
                f"{flag} belongs to the CPU bench; the CUDA bench does not take it.",
                got=f"--device cuda {flag}",
                expected="--device cuda without " + flag,
                fix=f"leave out {flag} (or --device cuda for the CPU bench)",
            )
