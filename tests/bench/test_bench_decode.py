"""``attnkit bench``'s decode group: its workloads (what they attend, the K/V bytes they must
read), its peers (SDPA on a hand-sliced window, onnxruntime's GroupQueryAttention where
installed) against the float64 oracle, and ``benchmarks/decode.py`` end to end on tiny rows.

Dimension legend: B batch, H query heads, Hkv key/value heads, S cache length, D head dim.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnkit import bench, masks
from attnkit.bench import ort
from attnkit.bench.peers import PEERS
from attnkit.bench.workloads import WORKLOADS, Inputs, ragged_lengths
from oracle import within_oracle_on

ROOT = Path(__file__).resolve().parents[2]
CAP = 8 << 30
HAS_ORT = ort.unavailable() is None


def _small(name: str) -> bench.Workload:
    """The workload with a window that fits the tests' short caches."""
    return dataclasses.replace(WORKLOADS[name], window=100)


def _check(out: torch.Tensor, inputs: Inputs, what: str) -> None:
    """``out`` within the tolerance rule of the float64 oracle on ``inputs``."""
    L, S = inputs.q.shape[2], inputs.k.shape[2]
    dense = None if inputs.spec is None else inputs.spec.to_dense(L, S)
    within_oracle_on(out, inputs.q, inputs.k, inputs.v, dense, what=what)


def test_decode_group_rows_and_their_peers() -> None:
    rows = bench.plan_rows(groups=["decode"])
    assert rows[0] == ("decode-gqa", 4096, "float32", "fwd")
    assert ("decode-ragged", 2048, "float32", "fwd") in rows
    assert ("decode-window", 16384, "float32", "fwd") in rows
    assert ("prefill-dense", 4096, "float32", "fwd") in rows
    assert ("decode-gqa", 64, "float32", "fwd") in rows  # the per-call overhead
    assert not set(rows) & set(bench.DEFAULT_ROWS)  # a group of its own, not the default run
    assert "sdpa-sliced" in bench.row_peers("decode-window", 16384, "float32")
    assert "ort-gqa" in bench.row_peers("decode-ragged", 2048, "float32")
    assert bench.row_peers("prefill-dense", 4096, "float32")[0] == "sdpa"


def test_decode_workloads_are_what_they_say() -> None:
    gqa = WORKLOADS["decode-gqa"].inputs(300, torch.float32)
    assert (gqa.q.shape, gqa.k.shape) == ((1, 32, 1, 128), (1, 8, 300, 128))
    ragged = WORKLOADS["decode-ragged"].inputs(2048, torch.float32)
    assert ragged.q.shape == (8, 32, 1, 128)
    lengths = ragged_lengths(8, 2048)
    assert int(lengths.max()) == 2048
    assert int(lengths.min()) >= 256
    assert len(set(lengths.tolist())) > 1  # ragged
    assert ragged.spec is not None
    want = masks.sequence_causal(lengths, 1).to_dense(1, 2048)
    assert torch.equal(ragged.spec.to_dense(1, 2048), want)
    window, _ = WORKLOADS["decode-window"].spec(1, 16384)
    assert window is not None
    assert int(window.to_dense(1, 16384).sum()) == 4096
    prefill = WORKLOADS["prefill-dense"].inputs(64, torch.float32)
    assert (prefill.q.shape, prefill.spec) == ((1, 16, 64, 64), None)


def test_kv_bytes_count_the_keys_a_query_may_see() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    per_key = 8 * 128 * 2  # Hkv x D, K and V
    assert WORKLOADS["decode-gqa"].kv_bytes(4096, f32) == 4096 * per_key * 4
    assert WORKLOADS["decode-gqa"].kv_bytes(4096, bf16) == 4096 * per_key * 2
    ragged = int(ragged_lengths(8, 2048).sum())
    assert WORKLOADS["decode-ragged"].kv_bytes(2048, f32) == ragged * per_key * 4
    assert WORKLOADS["decode-window"].kv_bytes(16384, f32) == 4096 * per_key * 4
    assert WORKLOADS["prefill-dense"].kv_bytes(1024, f32) == 1024 * 16 * 64 * 2 * 4


@pytest.mark.parametrize("name", ["decode-window", "decode-gqa"])
def test_sdpa_on_the_sliced_window_matches_the_oracle(name: str) -> None:
    wl = _small(name)
    inputs = wl.inputs(300, torch.float32)
    why = PEERS["sdpa-sliced"].skip(wl, 300, torch.float32, False, CAP)
    if name != "decode-window":
        assert why == "a decode row with a causal window only (one query: the window is a slice)"
        return
    assert why is None
    out = PEERS["sdpa-sliced"].setup(wl, inputs)()
    _check(out, inputs, name)


def test_ort_gqa_says_why_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    wl = WORKLOADS["decode-gqa"]
    real = importlib.util.find_spec

    def hide(name: str, *args: object) -> object:
        return None if name == "onnxruntime" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", hide)
    why = PEERS["ort-gqa"].skip(wl, 4096, torch.float32, False, CAP)
    assert why == "onnxruntime not installed (pip install 'attnkit[peers]' (onnxruntime and onnx))"
    monkeypatch.undo()
    if HAS_ORT:
        bf16 = PEERS["ort-gqa"].skip(wl, 4096, torch.bfloat16, False, CAP)
        assert "not torch.bfloat16" in str(bf16)
        dense = PEERS["ort-gqa"].skip(WORKLOADS["prefill-dense"], 64, torch.float32, False, CAP)
        assert dense == "GroupQueryAttention is causal over a KV cache: decode rows only"
        assert "forward only" in str(PEERS["ort-gqa"].skip(wl, 64, torch.float32, True, CAP))


@pytest.mark.skipif(not HAS_ORT, reason=f"onnxruntime's peer: {ort.unavailable()}")
@pytest.mark.parametrize("name", ["decode", "decode-gqa", "decode-ragged", "decode-window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ort_gqa_matches_the_oracle(name: str, dtype: torch.dtype) -> None:
    wl = _small(name)
    inputs = wl.inputs(300, dtype)
    assert PEERS["ort-gqa"].skip(wl, 300, dtype, False, CAP) is None
    out = PEERS["ort-gqa"].setup(wl, inputs)()
    assert out.shape == inputs.q.shape
    _check(out, inputs, f"{name} {dtype}")


def test_decode_benchmark_runs_and_writes_json(tmp_path: Path) -> None:
    """The program end to end on the decode group shrunk to tiny rows (the lengths patched)."""
    script = (
        "import sys, runpy, attnkit.bench.plan as p\n"
        "p.DECODE_ROWS[:] = [('decode-gqa', 64, 'float32', 'fwd'), "
        "('decode-window', 300, 'float32', 'fwd')]\n"
        "sys.argv = ['decode.py', '--reps', '1', '--no-model', '--json', sys.argv[1]]\n"
        f"runpy.run_path({str(ROOT / 'benchmarks' / 'decode.py')!r}, run_name='__main__')\n"
    )
    out = tmp_path / "d.json"
    done = subprocess.run(
        [sys.executable, "-c", script, str(out)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "memory read" in done.stdout
    assert "GB/s" in done.stdout
    assert "decode call at 64 cached keys" in done.stdout
    res = json.loads(out.read_text())["kernels"]
    assert res["read_gbps"] > 0
    labels = [r["row"] for r in res["rows"]]
    assert labels == ["decode-gqa L=64 float32 fwd", "decode-window L=300 float32 fwd"]
    sliced = {e["peer"]: e for e in res["rows"][1]["entries"]}
    assert sliced["sdpa"]["sdpa_over_this"] == 1.0
    assert sliced["sdpa-sliced"]["kv_gbps"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_mib", [1, 32, 256])
def test_decode_rows_turn_through_enough_copies_to_miss_the_cache(
    dtype: torch.dtype, cache_mib: int
) -> None:
    """A decode row's copies: the K/V read between two calls on one copy is at least twice the
    last-level cache, unless a cap (copies, bytes) stops it; every other row has one copy."""
    from attnkit.bench.workloads import MAX_COPIES, MAX_COPY_BYTES

    cache = cache_mib << 20
    size = torch.empty((), dtype=dtype).element_size()
    for wl in WORKLOADS.values():
        for L in (64, 2048, 4096):
            n = wl.copies(L, dtype, cache)
            if not wl.queries:
                assert n == 1, wl.name
                continue
            whole = wl.B * wl.Hkv * L * wl.D * 2 * size
            assert 1 <= n <= MAX_COPIES, (wl.name, L)
            assert n == 1 or n * whole <= MAX_COPY_BYTES, (wl.name, L)
            capped = n == MAX_COPIES or (n + 1) * whole > MAX_COPY_BYTES
            assert capped or (n - 1) * wl.kv_bytes(L, dtype) >= 2 * cache, (wl.name, L, n)
            assert n == 1 or (n - 2) * wl.kv_bytes(L, dtype) < 2 * cache, (wl.name, L, n)
    assert WORKLOADS["decode-gqa"].copies(4096, dtype, None) >= 2  # an unknown cache: 64 MiB


def test_a_timed_decode_row_reads_each_copy_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's timed calls go to copy 0, 1, ..., n-1, 0, ... (distinct K/V storage, equal
    values), and the result says how many copies there were."""
    from attnkit.bench import worker

    monkeypatch.setattr(worker, "last_level_cache_bytes", lambda: 1 << 20)
    seen: list[tuple[int, int]] = []
    sdpa = PEERS["sdpa"]

    class Spy(type(sdpa)):  # type: ignore[misc]
        def setup(self, wl: bench.Workload, inputs: Inputs):  # type: ignore[no-untyped-def]
            call = super().setup(wl, inputs)
            assert torch.equal(inputs.k, first_k)
            assert torch.equal(inputs.v, first_v)

            def run() -> torch.Tensor:
                seen.append((inputs.k.data_ptr(), inputs.v.data_ptr()))
                return call()

            return run

    wl = WORKLOADS["decode-gqa"]
    first = wl.inputs(64, torch.float32)
    first_k, first_v = first.k, first.v
    monkeypatch.setitem(PEERS, "spy", Spy("spy", "sdpa, recording the K/V it reads"))
    n = wl.copies(64, torch.float32, 1 << 20)
    assert n == 1 + 4  # 512 KiB read per call: 4 copies fill twice a 1 MiB cache
    job = {"kind": "time", "workload": "decode-gqa", "L": 64, "dtype": "float32", "reps": 7,
           "backward": False, "peers": ["spy"], "gemm_n": 0, "min_call_ms": 0}  # fmt: skip
    out = worker.run_job(job)
    assert "error" not in out["peers"]["spy"], out
    assert out["copies"] == n
    assert len(out["peers"]["spy"]["times"]) == 7
    untimed, timed = seen[:-7], seen[-7:]  # the probe (and warm-up) read copy 0
    assert untimed
    assert all(u == timed[0] for u in untimed)
    ks = [k for k, _ in timed]
    vs = [v for _, v in timed]
    assert len(set(ks[:n])) == n  # n distinct storages in turn
    assert len(set(vs[:n])) == n
    assert ks[n:] == ks[: 7 - n]  # then round again from copy 0
    assert vs[n:] == vs[: 7 - n]
