"""Worker processes for tests/distributed/test_ring.py (a script, run in a subprocess).

``python ring_workers.py OUTDIR SCENARIO:WORLD ...`` runs each scenario in turn on WORLD
processes forked from this one (gloo, rendezvous through a file, loopback sockets), and each
rank writes ``OUTDIR/SCENARIO-WORLD/rank{r}.json``. A scenario's processes are killed after 60 s,
and the test runs the script under a hard ``subprocess.run(timeout=...)``, so a bug that hangs
can never hang the test run.

Scenarios: ``correctness`` (every case of CASES, then the shape-mismatch check and masks or
settings whose contents differ between ranks), ``dies``
(rank 1 exits between forward and backward), ``absent`` (the last rank never calls).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the oracle

import attnkit
import attnkit.distributed as akd
from attnkit import masks
from attnkit.backends.blocked import gather
from attnkit.modules.positions import alibi
from oracle import reference_attention

FAULT_TIMEOUT_S = 4.0  # the timeout= the fault scenarios pass to ring_attention


@dataclass(frozen=True)
class Case:
    name: str
    n_q: int  # query tokens per rank
    n_k: int  # key tokens per rank
    causal: bool = False
    mask: Callable[[int, int], masks.MaskSpec | None] = lambda L, S: None
    B: int = 2
    H: int = 4
    Hkv: int = 2
    Dk: int = 8
    Dv: int = 6
    kv_heads_per_pass: int | None = None  # None: the default (all heads at once at these sizes)


def _padding(L: int, S: int) -> masks.MaskSpec:
    # sequence 1 has its last 5 keys padded; its query rows past L - 3 see nothing at all
    return masks.padding(torch.tensor([S, S - 5]), q_lengths=torch.tensor([L, L - 3]))


def _documents(L: int, S: int) -> masks.MaskSpec:
    ids = torch.zeros(S, dtype=torch.long)
    ids[S // 3 :] += 1
    ids[S // 3 + 5 :] += 1
    return masks.document(ids)


def _window_padding(L: int, S: int) -> masks.MaskSpec:
    return _padding(L, S) & masks.sliding_window(7)


def _selected(L: int, S: int, per_head: int | None = None, k: int = 6) -> masks.MaskSpec:
    """DeepSeek's top-k keys over the whole sequence: global key positions, one row per global
    query; -1 entries and a duplicate in row 0."""
    gen = torch.Generator().manual_seed(L * 1000 + S)
    shape = (2, L, k) if per_head is None else (2, per_head, L, k)
    ind = torch.randint(-1, S, shape, generator=gen)
    ind[..., 0, 1] = ind[..., 0, 0]
    return masks.selected_keys(ind, heads=None if per_head is None else 2 * per_head)


CASES = [
    Case("dense", 8, 8),
    Case("causal", 8, 8, causal=True),
    Case("padding", 8, 8, mask=_padding),
    Case("causal_padding", 8, 8, causal=True, mask=_padding),
    Case("window", 8, 8, mask=lambda L, S: masks.sliding_window(5)),
    Case("causal_window", 8, 8, causal=True, mask=lambda L, S: masks.sliding_window(6)),
    Case("causal_documents", 8, 8, causal=True, mask=_documents),
    Case("mqa_causal", 8, 8, causal=True, H=3, Hkv=1, Dk=5, Dv=7),
    Case("alibi_causal", 8, 8, causal=True, mask=lambda L, S: alibi(4)),
    Case("cross_lengths_causal", 4, 6, causal=True),
    # one group of heads at a time around the ring (what long sequences get by default)
    Case("causal_headwise", 8, 8, causal=True, kv_heads_per_pass=1),
    Case("padding_window_headwise", 8, 8, mask=_window_padding, H=6, Hkv=3, kv_heads_per_pass=2),
    Case(
        "alibi_causal_headwise",
        8,
        8,
        causal=True,
        mask=lambda L, S: alibi(4),
        Hkv=4,
        kv_heads_per_pass=1,
    ),
    # selected keys (indices: global key positions, rows: global queries): each pair runs the
    # gather kernel on its chunk's rows, with the entries in its key chunk
    Case("selected", 8, 8, mask=_selected),
    Case("selected_causal", 8, 8, causal=True, mask=lambda L, S: _selected(L, S, k=9)),
    Case("selected_cross_lengths", 4, 6, mask=lambda L, S: _padding(L, S) & _selected(L, S)),
    Case(
        "selected_per_head_headwise",
        8,
        8,
        causal=True,
        mask=lambda L, S: _selected(L, S, per_head=2),
        kv_heads_per_pass=1,
    ),
]


#: calls of the gather kernel (selected keys) in this process, by direction
GATHER_CALLS = {"forward": 0, "backward": 0}


def _counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        GATHER_CALLS[name] += 1
        return fn(*args)

    return run


gather.forward = _counted("forward", gather.forward)  # type: ignore[assignment]
gather.backward = _counted("backward", gather.backward)  # type: ignore[assignment]


def _errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    return [(g.double() - w.double()).abs().max().item() for g, w in zip(got, want, strict=True)]


def run_case(case: Case, dtype: torch.dtype, world: int) -> dict[str, Any]:
    """Ring vs one process: max abs errors of out, dq, dk, dv on this rank's shard."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    L, S = case.n_q * world, case.n_k * world
    q = torch.randn(case.B, case.H, L, case.Dk, generator=gen, dtype=torch.float64)
    k = torch.randn(case.B, case.Hkv, S, case.Dk, generator=gen, dtype=torch.float64)
    v = torch.randn(case.B, case.Hkv, S, case.Dv, generator=gen, dtype=torch.float64)
    g = torch.randn(case.B, case.H, L, case.Dv, generator=gen, dtype=torch.float64)
    spec = case.mask(L, S)
    # one process, the whole sequence, in the dtype under test (float64 is the reference)
    full = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    ref = attnkit.attention(*full, mask=spec, causal=case.causal)
    (ref * g.to(dtype)).sum().backward()
    # the ring, on this rank's shards
    parts = [
        akd.shard(t.to(dtype), causal=case.causal).detach().requires_grad_() for t in (q, k, v)
    ]
    before = dict(GATHER_CALLS)
    with akd.profile() as prof:
        out = akd.ring_attention(
            *parts, mask=spec, causal=case.causal, kv_heads_per_pass=case.kv_heads_per_pass
        )
        (out * akd.shard(g.to(dtype), causal=case.causal)).sum().backward()
    want = [akd.shard(t, causal=case.causal) for t in (ref, *(f.grad for f in full))]
    result: dict[str, Any] = {
        "errors": _errors([out, *(p.grad for p in parts)], want),
        "finite": all(bool(t.isfinite().all()) for t in (out, *(p.grad for p in parts))),
        "pairs": prof.total("pairs", "forward"),
        "skipped": prof.total("skipped", "forward"),
        "passes": len({s.part for s in prof.steps}),
        "gather_calls": {name: n - before[name] for name, n in GATHER_CALLS.items()},
    }
    if dtype == torch.float64:  # also against the independent float64 oracle
        dense = None if spec is None else spec.to_dense(L, S)
        oracle, _ = reference_attention(q, k, v, mask=dense, causal=case.causal)
        result["oracle_error"] = _errors([out], [akd.shard(oracle, causal=case.causal)])[0]
    return result


def run_roundtrip(world: int) -> dict[str, Any]:
    x = torch.randn(2, 4 * world, 3, generator=torch.Generator().manual_seed(0))
    res: dict[str, Any] = {}
    for causal in (False, True):
        xs = x.clone().requires_grad_()
        part = akd.shard(xs, causal=causal)
        back = akd.unshard(part, causal=causal)
        pos = akd.shard_positions(x.shape[1], causal=causal)
        (back * torch.arange(back.numel()).view_as(back)).sum().backward()
        grad_rows = xs.grad[:, pos] if xs.grad is not None else None
        res[f"causal={causal}"] = {
            "equal": bool(torch.equal(back, x)),
            "positions_match": bool(torch.equal(part, x[:, pos])),
            "grad_ok": grad_rows is not None
            and bool(torch.equal(grad_rows, torch.arange(x.numel()).view_as(x)[:, pos].float())),
        }
    return res


def run_module(world: int) -> dict[str, Any]:
    """A causal pre-norm transformer stack, parallelized, against the same stack on one process."""
    torch.manual_seed(0)
    cfg = attnkit.modules.transformer.TransformerConfig(
        dim=16, num_heads=4, causal=True, norm_first=True
    )
    model = attnkit.modules.transformer.TransformerStack(cfg, num_layers=2).double()
    x = torch.randn(2, 8 * world, 16, dtype=torch.float64)
    kpm = torch.ones(2, 8 * world, dtype=torch.bool)
    kpm[1, -3:] = False
    ref = model(x, attention_mask=kpm).last_hidden_state  # True = a real token
    ref.square().sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    keys = list(model.state_dict())
    model.zero_grad()
    akd.parallelize(model)
    out = model(akd.shard(x, causal=True), key_padding_mask=~kpm).last_hidden_state
    out.square().sum().backward()
    grad_err = 0.0
    for n, p in model.named_parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)  # each rank holds its tokens' part of the parameter gradient
        grad_err = max(grad_err, (p.grad - ref_grads[n]).abs().max().item())
    return {
        "out_error": (out - akd.shard(ref, causal=True)).abs().max().item(),
        "grad_error": grad_err,
        "same_keys": list(model.state_dict()) == keys,
        "wrapped": sum(isinstance(m, akd.SequenceParallel) for m in model.modules()),
    }


def run_mismatch(rank: int) -> dict[str, Any]:
    n = 8 if rank != 1 else 6  # rank 1 holds a shard of another length
    q = torch.randn(1, 2, n, 4)
    try:
        akd.ring_attention(q, q, q)
    except attnkit.AttentionInputError as e:
        return {"raised": "AttentionInputError", "message": str(e)}
    return {"raised": None, "message": ""}


class _Near(masks.MaskSpec):
    """A user's spec holding a function (its digest reads the function's code)."""

    def __init__(self, size: int) -> None:
        self.rule = lambda d: d < size

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return self.rule((q + off - kv).abs())

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        every = torch.ones(q_lo.shape[0], k_lo.shape[1], dtype=torch.bool)
        return every[None, None], ~every[None, None]

    def __repr__(self) -> str:
        return "near()"


def outcomes(calls: dict[str, Callable[[], object]]) -> dict[str, Any]:
    """Each call's outcome, by name: the exception it raised (its type's name and message),
    or none."""
    res: dict[str, Any] = {}
    for name, call in calls.items():
        try:
            call()
            res[name] = {"raised": None, "message": ""}
        except Exception as e:
            res[name] = {"raised": type(e).__name__, "message": str(e)}
    return res


def run_disagreements(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 passes a mask (or scale) whose repr is every other rank's but whose contents
    differ: every rank must raise the same AttentionInputError, at once (not a RingError after
    the timeout), and equal masks built apart must pass."""
    N, odd = 8 * world, rank == 1
    ids = torch.zeros(N, dtype=torch.long)
    ids[N // 2 + (1 if odd else 0) :] = 1  # one token changes document on rank 1
    keep = torch.ones(2, N, dtype=torch.bool)
    keep[1, 3 if odd else 4] = False
    dense = torch.ones(N, N, dtype=torch.bool).tril()
    dense[-1, 0] = not odd
    q = akd.shard(torch.randn(2, 2, N, 4, generator=torch.Generator().manual_seed(0)))

    def ring(**kw: Any) -> torch.Tensor:
        return akd.ring_attention(q, q, q, timeout=FAULT_TIMEOUT_S, **kw)

    calls: dict[str, Callable[[], object]] = {
        "document": lambda: ring(mask=masks.document(ids)),
        "causal_document": lambda: ring(mask=masks.causal() & masks.document(ids)),
        "key_mask": lambda: ring(mask=masks.key_mask(keep)),
        "dense": lambda: ring(mask=masks.as_spec(dense)),
        "key_padding_mask": lambda: akd.SequenceParallel(
            attnkit.MultiHeadAttention(8, 2), timeout=FAULT_TIMEOUT_S
        )(akd.shard(torch.randn(2, N, 8)), key_padding_mask=~keep),
        "scale": lambda: ring(scale=0.5 + (1e-12 if odd else 0.0)),
        # the same contents in tensors built apart, and a user's spec holding a function
        "same": lambda: ring(mask=masks.document(torch.zeros(N, dtype=torch.long)) & _Near(3)),
    }
    res: dict[str, Any] = outcomes(calls)
    specs = {"document": masks.document(ids), "key_mask": masks.key_mask(keep)}
    specs["dense"] = masks.as_spec(dense)
    try:  # what the messages should show (the calls above are checked on their own)
        res["digests"] = {name: spec.digest() for name, spec in specs.items()}
    except Exception:
        res["digests"] = {"exception": traceback.format_exc()}
    return res


def correctness(rank: int, world: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for case in CASES:
        for dtype in (torch.float64, torch.float32):
            key = f"{case.name}/{str(dtype).removeprefix('torch.')}"
            t0 = time.perf_counter()
            try:
                res[key] = run_case(case, dtype, world)
            except Exception:
                res[key] = {"exception": traceback.format_exc()}
            res[key]["seconds"] = time.perf_counter() - t0
    for name, fn in (
        ("roundtrip", lambda: run_roundtrip(world)),
        ("module", lambda: run_module(world)),
        ("mismatch", lambda: run_mismatch(rank)),
        ("disagreements", lambda: run_disagreements(rank, world)),
    ):
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception:
            res[name] = {"exception": traceback.format_exc()}
        res[name]["seconds"] = time.perf_counter() - t0
    return res


def _fault_call(rank: int, world: int, role: str) -> dict[str, Any]:
    """The ranks that stay in the call: time from the call to the RingError, and its text."""
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    t0 = time.monotonic()
    try:
        out = akd.ring_attention(q, q, q, timeout=FAULT_TIMEOUT_S)
        if role == "dies" and rank == 1:
            os._exit(17)  # dies between forward and backward, without a word
        out.sum().backward()
    except akd.RingError as e:
        return {"raised": "RingError", "seconds": time.monotonic() - t0, "message": str(e)}
    except Exception as e:
        return {"raised": type(e).__name__, "seconds": time.monotonic() - t0, "message": str(e)}
    return {"raised": None, "seconds": time.monotonic() - t0, "message": ""}


def join_group(rank: int, world: int, outdir: str) -> None:
    """Join the group: one torch thread per rank, gloo on loopback, rendezvous through a file
    in ``outdir``."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{outdir}/rendezvous",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )


def worker(rank: int, world: int, scenario: str, outdir: str) -> None:
    t_start = time.perf_counter()
    join_group(rank, world, outdir)
    if scenario == "absent" and rank == world - 1:
        # alive and in the group, but never makes the call; leaves once the others are done
        others = [Path(outdir, f"rank{r}.json") for r in range(world - 1)]
        deadline = time.monotonic() + 3 * FAULT_TIMEOUT_S
        while time.monotonic() < deadline and not all(p.exists() for p in others):
            time.sleep(0.1)
        res: dict[str, Any] = {"absent": True}
    elif scenario in ("dies", "absent"):
        res = _fault_call(rank, world, scenario)
    else:
        res = correctness(rank, world)
    res["worker_seconds"] = time.perf_counter() - t_start
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(res))
    os._exit(0)  # skip teardown: after a fault the group cannot be destroyed cleanly


def launch(
    scenario: str,
    world: int,
    outdir: Path,
    limit_s: float,
    target: Callable[[int, int, str, str], None] = worker,
) -> None:
    """Run one scenario on ``world`` forked processes (each ``target(rank, world, scenario,
    outdir)``); kill them after ``limit_s`` seconds."""
    outdir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("fork")  # torch is imported once, here, not once per rank
    procs = [
        ctx.Process(target=target, args=(r, world, scenario, str(outdir))) for r in range(world)
    ]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=max(0.1, limit_s - (time.monotonic() - t0)))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    Path(outdir, "launch.json").write_text(
        json.dumps({"seconds": time.monotonic() - t0, "exitcodes": codes})
    )


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for spec in sys.argv[2:]:  # scenario:world, run one after the other
        name, size = spec.split(":")
        launch(name, int(size), root / f"{name}-{size}", limit_s=60.0)
