"""Worker processes for tests/distributed/test_ring_sinks.py (a script, run in a subprocess).

``python ring_sinks_workers.py OUTDIR WORLD ...`` runs the ``sinks`` scenario on WORLD gloo
processes forked from this one (ring_workers.py's launcher: rendezvous through a file, killed
after 60 s), and each rank writes ``OUTDIR/sinks-WORLD/rank{r}.json``: ring attention with
attention sinks against one process's attnkit.attention on the whole sequence (and, in
float64, the oracle); a parallelized stack with learned sinks against one process; the second
derivatives; and the sinks the ring refuses.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ring_workers
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the oracle

from ring_sink_cases import KINDS, SINK_CASES
from ring_workers import CASES, FAULT_TIMEOUT_S, Case, join_group, launch, outcomes

import attnkit
import attnkit.distributed as akd
from attnkit.modules.transformer import TransformerConfig, TransformerStack
from oracle import reference_attention


def _sinks(kind: str, B: int, H: int, L: int, gen: torch.Generator) -> torch.Tensor:
    """Sinks of the whole sequence, float64, spread widely (from never taken to most taken)."""
    shape = {"H": (H,), "BHL": (B, H, L), "1HL": (1, H, L)}[kind]
    return torch.randn(shape, generator=gen, dtype=torch.float64) * 2


def _shard_rows(sinks: torch.Tensor, causal: bool) -> torch.Tensor:
    """This rank's query rows of sinks: per head as they are, per token sharded as q."""
    if sinks.dim() == 1:
        return sinks
    return akd.shard(sinks.unsqueeze(-1), causal=causal).squeeze(-1)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def run_case(case: Case, kind: str, dtype: torch.dtype, world: int) -> dict[str, Any]:
    """Ring vs one process: max abs errors of out, dq, dk, dv, dsinks on this rank's part (the
    per-head sinks' gradient summed over the ranks first)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{kind}".encode()))
    L, S = case.n_q * world, case.n_k * world
    q = torch.randn(case.B, case.H, L, case.Dk, generator=gen, dtype=torch.float64)
    k = torch.randn(case.B, case.Hkv, S, case.Dk, generator=gen, dtype=torch.float64)
    v = torch.randn(case.B, case.Hkv, S, case.Dv, generator=gen, dtype=torch.float64)
    sinks = _sinks(kind, case.B, case.H, L, gen)
    g = torch.randn(case.B, case.H, L, case.Dv, generator=gen, dtype=torch.float64)
    spec = case.mask(L, S)
    full = [t.to(dtype).requires_grad_() for t in (q, k, v, sinks)]
    ref = attnkit.attention(*full[:3], mask=spec, causal=case.causal, sinks=full[3])
    (ref * g.to(dtype)).sum().backward()
    c = case.causal
    parts = [akd.shard(t.to(dtype), causal=c).detach().requires_grad_() for t in (q, k, v)]
    mine = _shard_rows(sinks.to(dtype), c).detach().requires_grad_()
    with akd.profile() as prof:
        out = akd.ring_attention(
            *parts, mask=spec, causal=c, kv_heads_per_pass=case.kv_heads_per_pass, sinks=mine
        )
        (out * akd.shard(g.to(dtype), causal=c)).sum().backward()
    assert mine.grad is not None
    assert full[3].grad is not None
    dsinks = mine.grad.clone()
    if kind == "H":
        dist.all_reduce(dsinks)  # each rank holds its rows' part
    want = [akd.shard(t, causal=c) for t in (ref, *(f.grad for f in full[:3]))]
    want.append(_shard_rows(full[3].grad, c))
    got = [out, *(p.grad for p in parts), dsinks]
    result: dict[str, Any] = {
        "errors": [_max_err(a, b) for a, b in zip(got, want, strict=True)],
        "finite": all(bool(t.isfinite().all()) for t in got),
        "dsinks_shape": list(mine.grad.shape),
        "passes": len({s.part for s in prof.steps}),
    }
    if dtype == torch.float64:  # also against the independent float64 oracle
        dense = None if spec is None else spec.to_dense(L, S)
        oracle, _ = reference_attention(q, k, v, mask=dense, causal=c, sinks=sinks)
        result["oracle_error"] = _max_err(out, akd.shard(oracle, causal=c))
    return result


def run_module(world: int) -> dict[str, Any]:
    """A causal pre-norm stack with learned sinks, parallelized, against one process: the
    output, and every parameter's gradient (the sinks' included) summed over the ranks."""
    torch.manual_seed(0)
    cfg = TransformerConfig(dim=16, num_heads=4, causal=True, norm_first=True,
                            attention_sinks=True)  # fmt: skip
    model = TransformerStack(cfg, num_layers=2).double()
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.sinks.normal_(std=2.0)
    x = torch.randn(2, 8 * world, 16, dtype=torch.float64)
    ref = model(x).last_hidden_state
    ref.square().sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    keys = list(model.state_dict())
    model.zero_grad()
    akd.parallelize(model)
    out = model(akd.shard(x, causal=True)).last_hidden_state
    out.square().sum().backward()
    errors = {}
    for n, p in model.named_parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        errors[n] = (p.grad - ref_grads[n]).abs().max().item()
    return {
        "out_error": (out - akd.shard(ref, causal=True)).abs().max().item(),
        "grad_error": max(errors.values()),
        "sinks_grad_error": max(e for n, e in errors.items() if n.endswith("sinks")),
        "same_keys": list(model.state_dict()) == keys,
    }


def _penalty_grads(
    q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor, ring: bool
) -> list[torch.Tensor]:
    """The gradients of q and the sinks of ``|dq|^2``, ``dq`` of ``|out|^2`` (each rank's
    rows, so the ranks' penalties add up to the whole sequence's)."""
    leaves = [q.requires_grad_(), sinks.requires_grad_()]
    if ring:
        out = akd.ring_attention(q, kv, kv, causal=True, sinks=sinks)
    else:
        out = attnkit.attention(q, kv, kv, causal=True, sinks=sinks, backend="math")
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    return list(torch.autograd.grad(dq.square().sum(), leaves))


def run_second_order(world: int) -> dict[str, Any]:
    """A gradient penalty through the ring with sinks (per head and per token), against the
    math backend on the whole sequence, float64 (:func:`_penalty_grads`)."""
    res = {}
    for kind in ("H", "BHL"):
        gen = torch.Generator().manual_seed(7)
        B, H, Hkv, L, D = 1, 2, 1, 4 * world, 3
        q = torch.randn(B, H, L, D, generator=gen, dtype=torch.float64)
        kv = torch.randn(B, Hkv, L, D, generator=gen, dtype=torch.float64)
        sinks = _sinks(kind, B, H, L, gen)
        want = _penalty_grads(q.clone(), kv, sinks.clone(), ring=False)
        mine = _shard_rows(sinks, True).clone()
        got = _penalty_grads(akd.shard(q, causal=True), akd.shard(kv, causal=True), mine, True)
        if kind == "H":
            dist.all_reduce(got[1])
        res[kind] = {
            "dq": _max_err(got[0], akd.shard(want[0], causal=True)),
            "dsinks": _max_err(got[1], _shard_rows(want[1], True)),
            "size": want[1].abs().max().item(),
        }
    return res


def run_refusals(rank: int, world: int) -> dict[str, Any]:
    """Sinks the ring refuses: the whole sequence's per-token sinks, another shape (on every
    rank, before any K/V moves), and sinks that differ between the ranks (the same error on
    every rank, from the agreement)."""
    N, H = 8 * world, 2
    q = akd.shard(torch.randn(2, H, N, 4, generator=torch.Generator().manual_seed(0)))
    odd = rank == 1

    def ring(sinks: torch.Tensor | None) -> torch.Tensor:
        return akd.ring_attention(q, q, q, timeout=FAULT_TIMEOUT_S, sinks=sinks)

    calls: dict[str, Callable[[], object]] = {
        "whole_sequence": lambda: ring(torch.zeros(2, H, N)),
        "shape": lambda: ring(torch.zeros(H + 1)),
        "values": lambda: ring(torch.tensor([0.5, 1.0 + (1e-6 if odd else 0.0)])),
        "presence": lambda: ring(None if odd else torch.zeros(H)),
        "per_token_and_per_head": lambda: ring(torch.zeros(2, H, 8) if odd else torch.zeros(H)),
        "module_both": lambda: akd.SequenceParallel(
            attnkit.MultiHeadAttention(8, 2, sinks=True), timeout=FAULT_TIMEOUT_S
        )(akd.shard(torch.randn(2, N, 8)), sinks=torch.zeros(2)),
    }
    return outcomes(calls)


def sinks_scenario(rank: int, world: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    cases = [c for c in CASES if c.name in SINK_CASES]
    jobs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        (f"{c.name}/{kind}/{str(d).removeprefix('torch.')}",
         lambda c=c, kind=kind, d=d: run_case(c, kind, d, world))
        for c in cases for kind in KINDS for d in (torch.float64, torch.float32)
    ]  # fmt: skip
    jobs += [
        ("module", lambda: run_module(world)),
        ("second_order", lambda: run_second_order(world)),
        ("refusals", lambda: run_refusals(rank, world)),
    ]
    for name, fn in jobs:
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception:
            res[name] = {"exception": traceback.format_exc()}
        res[name]["seconds"] = time.perf_counter() - t0
    return res


def worker(rank: int, world: int, scenario: str, outdir: str) -> None:
    join_group(rank, world, outdir)
    res = sinks_scenario(rank, world)
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(res))
    os._exit(0)  # skip teardown, as ring_workers.py's workers do


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for size in sys.argv[2:]:
        launch("sinks", int(size), root / f"sinks-{size}", limit_s=60.0, target=worker)
