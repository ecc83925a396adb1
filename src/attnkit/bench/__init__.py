"""``attnkit bench``: attnkit against torch's own ways to compute attention, side by side.

Workloads (:mod:`attnkit.bench.workloads`): dense, causal, key padding, causal sliding window
256, 8 packed documents, prefix-LM, grouped-query 32/8 heads, decode, and module rows; at the
lengths asked, forward or forward + backward, float32 or bfloat16. Peers
(:mod:`attnkit.bench.peers`): the seed tutorials' code with a dense mask, SDPA with a dense mask
or ``is_causal``, ``nn.MultiheadAttention``, compiled ``flex_attention`` (its compile timed
apart), and every attnkit backend. Each row reports, per peer, the median time of interleaved
calls, useful GFLOP/s (allowed pairs only) and its fraction of the machine's fp32 GEMM, the peak
memory above the inputs (a fresh process per case), and the time over the best peer's.

>>> from attnkit import bench
>>> rows = bench.plan_rows(quick=True)
>>> rows[0]
('dense', 512, 'float32', 'fwd')
>>> result = bench.run(rows, reps=5)  # doctest: +SKIP
>>> bench.print_table(result)  # doctest: +SKIP
"""

from attnkit.bench.peers import PEERS, peer_names
from attnkit.bench.report import (
    acceptance,
    print_table,
    to_markdown,
    write_json,
    write_markdown,
    write_plot,
)
from attnkit.bench.runner import (
    ACCEPTANCE_ROWS,
    BenchResult,
    Entry,
    Row,
    check_options,
    check_rows,
    plan_rows,
    run,
)
from attnkit.bench.workloads import WORKLOADS, Workload, allowed_pairs

__all__ = [
    "ACCEPTANCE_ROWS",
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
    "peer_names",
    "plan_rows",
    "print_table",
    "run",
    "to_markdown",
    "write_json",
    "write_markdown",
    "write_plot",
]
