"""``attnkit bench``: attnkit against torch's own ways to compute attention, side by side.

Workloads (:mod:`attnkit.bench.workloads`): dense, causal, key padding, causal sliding window
256, 8 packed documents (random or equal lengths), prefix-LM, grouped-query 32/8 heads (causal,
or with the causal window), decode, the decode group's (a decode step with grouped-query 32/8
heads of 128, a ragged batch of 8, a 4096 window over the cache, a dense prefill of 16 heads),
and module rows; at the lengths asked, forward or forward + backward, float32 or bfloat16. Rows
(:mod:`attnkit.bench.plan`): the default run's, in named groups (``acceptance``, ``masks``;
``decode`` runs on its own), or any selection. Peers (:mod:`attnkit.bench.peers`): the seed
tutorials' code with a dense mask, SDPA with a dense mask or ``is_causal`` (or on a hand-sliced
window), ``nn.MultiheadAttention``, compiled ``flex_attention`` (its compile timed apart),
onnxruntime's GroupQueryAttention (optional, :mod:`attnkit.bench.ort`), every attnkit backend,
and attnkit on float32 copies of a bfloat16 row. Each row reports, per peer, the median time of
interleaved calls, useful GFLOP/s (allowed pairs only) and its fraction of the machine's fp32
GEMM, the peak memory above the inputs (a fresh process per case), and the time over the best
peer's; decode rows also the rate K/V is read at, next to the machine's memory read bandwidth;
the record names the CPU's features (:mod:`attnkit.bench.machine`). What a run measured, and
the criteria it is judged on: :mod:`attnkit.bench.results`; shown and written by
:mod:`attnkit.bench.report`, for this bench and for the GPU's (:mod:`attnkit.bench.cuda`).

>>> from attnkit import bench
>>> rows = bench.plan_rows(quick=True)
>>> rows[0]
('dense', 512, 'float32', 'fwd')
>>> result = bench.run(rows, reps=5)  # doctest: +SKIP
>>> bench.print_table(result)  # doctest: +SKIP
"""

from attnkit.bench.machine import cpu_features
from attnkit.bench.peers import PEERS, peer_names
from attnkit.bench.plan import (
    ACCEPTANCE_ROWS,
    DEFAULT_ROWS,
    GROUPS,
    MASKS_ROWS,
    check_options,
    check_rows,
    plan_rows,
    row_peers,
)
from attnkit.bench.report import (
    print_table,
    to_markdown,
    write_json,
    write_markdown,
    write_plot,
)
from attnkit.bench.results import BenchResult, Entry, Row, acceptance
from attnkit.bench.runner import run
from attnkit.bench.workloads import WORKLOADS, Workload, allowed_pairs

__all__ = [
    "ACCEPTANCE_ROWS",
    "DEFAULT_ROWS",
    "GROUPS",
    "MASKS_ROWS",
    "PEERS",
    "WORKLOADS",
    "BenchResult",
    "Entry",
    "Row",
    "Workload",
    "acceptance",
    "allowed_pairs",
    "check_options",
    "check_rows",
    "cpu_features",
    "peer_names",
    "plan_rows",
    "print_table",
    "row_peers",
    "run",
    "to_markdown",
    "write_json",
    "write_markdown",
    "write_plot",
]
