"""The ``flex`` backend: torch's ``flex_attention``, compiled, driven by attnkit's mask specs.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
Dk query/key head dim, Dv value head dim.

A spec's ``allowed`` predicate becomes flex's ``mask_mod`` (evaluated at raw indices with the
end-aligned offset ``S - L``); its block mask is built from attnkit's own 128 x 128 block map
(``BlockMask.from_kv_blocks``: full blocks skip the predicate, empty blocks are never visited),
so the L x S mask is never materialised. ``flex_attention`` is compiled once
(``torch.compile(dynamic=False)``: torch's dynamic-shape CPU kernels do not build here), and
torch compiles one kernel per shape and mask; the block masks are cached per (spec, shape,
dtype), so after the first call of a kind the per-call cost is the kernel alone. The first
call's time (the compile) is kept per cache entry and reported by :func:`attnkit.explain`.

Inside ``torch.compile`` the backend calls ``flex_attention`` itself, which Dynamo compiles into
the caller's graph, with a block mask built in that graph by ``create_block_mask`` from the
spec's predicate (attnkit's block map and caches read values and ids, which a graph cannot).

On CPU, this torch's compiled ``flex_attention`` runs inference only (no backward), in float32,
bfloat16 and float16; its decision says so instead of failing inside the compiler, and ``auto``
uses flex only when named. On CUDA it trains too, and ``auto`` tries it first
(:func:`_rule`): for a mask spec, and for what torch's fused SDPA kernels cannot
serve (grouped-query heads in float32). docs/cuda.md has what has run on a GPU (nothing yet).
"""

from __future__ import annotations

import importlib.util
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from attnkit.backends.base import Backend, Decision, mask_planning
from attnkit.backends.registry import decision
from attnkit.call import AttentionCall
from attnkit.masks import FULL, PARTIAL, MaskSpec, block_states

__all__ = ["BLOCK", "FlexBackend", "unavailable"]

BLOCK = 128  #: flex_attention's block size
CACHE_SIZE = 16
MIN_HEAD_DIM = 16  #: flex_attention's CUDA kernels refuse smaller head dims
_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class _Entry:
    block_mask: Any
    seconds: float | None = None  # the first call's time, compile included
    calls: int = 0


_CACHE: OrderedDict[Hashable, _Entry] = OrderedDict()
_COMPILED: list[Callable[..., torch.Tensor]] = []


def unavailable() -> str | None:
    """Why flex cannot run in this torch, or ``None`` (without importing it: that takes
    seconds, and is left to the first call)."""
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:  # torch < 2.5
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    return None


def _compiled() -> Callable[..., torch.Tensor]:
    if not _COMPILED:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED[0]


def _key(spec: MaskSpec | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Hashable:
    skey = spec.key() if spec is not None else ()
    # a spec attnkit cannot key by value is keyed by identity (the entry keeps it alive)
    ident = skey if skey is not None else ("id", id(spec))
    return (ident, tuple(q.shape), tuple(k.shape), v.shape[-1], q.dtype, q.device)


def _block_mask(spec: MaskSpec, B: int, H: int, L: int, S: int, device: torch.device) -> Any:
    """flex's BlockMask from attnkit's block map: partial blocks run the spec's predicate."""
    from torch.nn.attention.flex_attention import BlockMask

    off = S - L
    state = block_states(spec, L, S, BLOCK, device=device)  # (B', 1, nq, nk)

    def lists(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = sel.sum(-1).to(torch.int32)  # (B', 1, nq)
        idx = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num, idx  # the selected key blocks first, in order

    partial_num, partial_idx = lists(state == PARTIAL)
    full_num, full_idx = lists(state == FULL)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> Any:
        return spec.allowed(b, h, q, kv, off)

    return BlockMask.from_kv_blocks(
        partial_num,
        partial_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(L, S),
    )


def _entry(spec: MaskSpec | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> _Entry:
    key = _key(spec, q, k, v)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    B, H, L, _ = q.shape
    S = k.shape[2]
    bm = None if spec is None else _block_mask(spec, B, H, L, S, q.device)
    entry = _Entry(bm)
    _CACHE[key] = entry
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    return entry


def _run_traced(call: AttentionCall) -> torch.Tensor:
    """Inside ``torch.compile``: ``flex_attention`` itself, compiled with the caller's graph,
    and its block mask built in that graph by ``create_block_mask`` from the spec's predicate
    (attnkit's block map and the mask cache read values and ids, which a graph cannot)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    spec = call.mask
    block_mask = None
    if spec is not None:
        L, S = call.dims.L, call.dims.S
        off = S - L

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> Any:
            return spec.allowed(b, h, q, kv, off)

        block_mask = create_block_mask(
            mask_mod, spec.batch, spec.heads, L, S, device=call.q.device, BLOCK_SIZE=BLOCK
        )
    return flex_attention(
        call.q,
        call.k,
        call.v,
        block_mask=block_mask,
        scale=call.scale,
        enable_gqa=call.grouped,
    )


def _refusal(call: AttentionCall) -> str | None:
    """Why flex cannot serve the call, or ``None``."""
    reason = unavailable()
    if reason is not None:
        return reason
    if call.return_weights:
        return "flex_attention does not return the attention weights (return_weights=True)"
    if call.dropout_p > 0.0:
        return "flex_attention has no dropout (dropout_p > 0)"
    if call.softcap is not None or call.sinks is not None:
        return "soft-cap and sinks are not wired into flex's score_mod; blocked serves them"
    mask = call.mask
    if mask is not None and mask.from_tensor:
        return (
            "it takes mask specs (attnkit.masks), which flex evaluates block by block; a "
            "dense mask tensor gives it nothing to skip (sdpa or blocked serve it)"
        )
    if mask is not None and mask.has_bias:
        return "score biases (has_bias) are not wired into flex's score_mod; blocked adds them"
    if mask is not None and mask.selects_keys:
        return (
            "selected keys (selected_keys) have no block bounds flex could skip by; blocked's "
            "gather kernel reads only each query's selected keys"
        )
    q = call.q
    device = call.device_type
    if device == "cuda":
        if q.dtype not in _CPU_DTYPES:
            return f"flex on CUDA compiles float32, bfloat16 and float16, not {q.dtype}"
        small = min(call.dims.Dk, call.dims.Dv)
        if small < MIN_HEAD_DIM:
            return (
                f"flex_attention's CUDA kernels need head dims of at least {MIN_HEAD_DIM} "
                f"(Dk={call.dims.Dk}, Dv={call.dims.Dv})"
            )
        return None
    if device == "cpu":
        if q.dtype not in _CPU_DTYPES:
            return f"flex on CPU compiles float32, bfloat16 and float16, not {q.dtype}"
        if call.needs_grad:
            return (
                f"torch {torch.__version__}'s flex_attention has no backward on CPU (a "
                "gradient is needed); blocked trains with mask specs"
            )
    L, S = call.dims.L, call.dims.S
    if L <= BLOCK and S <= BLOCK:
        return (
            f"L = {L} and S = {S} fit in one {BLOCK} x {BLOCK} block: flex has nothing to "
            "skip, and would compile a kernel for this shape (seconds); sdpa or blocked "
            "serve it"
        )
    return None


def _rule(call: AttentionCall) -> tuple[bool, str] | None:
    """On CUDA (its only device in ``auto``'s order), ``auto`` takes flex for a mask spec (it
    visits only the spec's non-empty blocks) and for what torch's fused SDPA kernels cannot
    serve (grouped-query heads in float32 whose repeated K and V exceed the memory limit,
    ``Dv != Dk``, ...: it reads the ``sdpa`` backend's
    decision for the call, which the dispatcher then reuses), before ``blocked`` (torch matmuls
    on tiles there) and ``math``."""
    if call.device_type != "cuda":
        return None
    spec, L, S = call.mask, call.dims.L, call.dims.S
    flag = spec is None or spec.from_tensor or (call.causal and L == S)
    small = L <= BLOCK and S <= BLOCK
    if not flag and not small:  # decided without asking sdpa (that would build the mask)
        return True, (
            "a mask spec on CUDA: flex's compiled kernel visits only the non-empty "
            f"{BLOCK} x {BLOCK} blocks of the spec's block map (the block mask is built "
            "from it once per spec and shape, and cached)"
        )
    try:  # no mask, a tensor, the causal flag, or one block: what sdpa decides
        sdpa_why = decision(call, "sdpa").reason
    except KeyError:
        sdpa_why = "no backend named 'sdpa' is registered"
    if sdpa_why is not None:
        return True, (
            f"torch's fused SDPA kernels cannot serve this call ({sdpa_why}); flex's "
            "compiled kernel is the next fused path on CUDA"
        )
    if not flag:
        return False, (
            f"L = {L} and S = {S} fit in one {BLOCK} x {BLOCK} block: nothing to skip; "
            "sdpa on the materialised mask needs no compile"
        )
    what = "no mask" if spec is None else "the causal flag"
    what = "a mask tensor" if spec is not None and spec.from_tensor else what
    return False, (
        f"{what}: torch's fused SDPA kernel takes the call as it is, with no blocks to skip"
    )


def _note(call: AttentionCall) -> str:
    """Whether the kernel for this call is compiled, what its compile took, and what a call
    inside ``torch.compile`` runs instead."""
    entry = _CACHE.get(_key(call.mask, call.q, call.k, call.v))
    if entry is None or entry.seconds is None:
        took = "tens of seconds on a 2-core CPU" if call.device_type == "cpu" else "seconds"
        state = (
            "not compiled for this shape and mask yet: the first call compiles "
            f"({took}), later calls run the cached kernel"
        )
    else:
        state = (
            f"compiled and cached for this shape and mask (the first call took "
            f"{entry.seconds:.1f} s, compile included); {entry.calls} calls since"
        )
    path = ""
    if call.cpu_path is not None:  # torch compiles it: attnkit's CPU path does not apply
        path = f"; takes q, k, v in {call.q.dtype} as they are (the CPU path is not applied)"
    return (
        state
        + path
        + (
            "; under torch.compile, flex_attention is compiled into the caller's graph and its "
            "block mask built there by create_block_mask (the spec's predicate on every pair)"
        )
    )


class FlexBackend(Backend):
    name = "flex"
    description = "torch's flex_attention, compiled once per mask and shape (inference only on CPU)"
    priorities = {"cuda": 40}  # noqa: RUF012 (on CPU: only when named)
    fused = True

    def decide(self, call: AttentionCall) -> Decision:
        """Whether flex serves the call (:func:`_refusal`), auto's rule on CUDA (:func:`_rule`)
        and the compile state for explain. Its plan, the block mask, is built (and cached per
        spec and shape) when it runs, so a decision costs no block map."""
        reason = _refusal(call)
        if reason is not None:
            return Decision(self.name, reason=reason)
        note = _note(call) if call.explaining else None
        return Decision(self.name, rule=_rule(call), memory=mask_planning(call), note=note)

    def run(
        self, call: AttentionCall, plan: None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if torch.compiler.is_compiling():
            return _run_traced(call), None
        q, k, v = call.q, call.k, call.v
        entry = _entry(call.mask, q, k, v)
        fn = _compiled()
        t0 = time.perf_counter()
        # one kernel per shape and mask: let dynamo keep them all, and fail loudly rather than
        # fall back to eager flex if it ever cannot
        with torch._dynamo.config.patch(recompile_limit=256, fail_on_recompile_limit_hit=True):
            out = fn(
                q,
                k,
                v,
                block_mask=entry.block_mask,
                scale=call.scale,
                enable_gqa=call.grouped,
            )
        if entry.seconds is None:
            entry.seconds = time.perf_counter() - t0
        entry.calls += 1
        return out, None
