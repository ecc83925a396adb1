"""auto's measured rules on the CPU: per dtype and instruction set, which calls attnkit's own
kernels take from torch's SDPA, and the benchmark each rule was measured with.

The blocked backend's kernels (the row-span kernel for plain causal and unmasked calls, the decode
kernel for decode steps) compete with torch's fused SDPA kernel on three kinds of call where SDPA
needs no mask tensor: ``causal`` (plain causal, no other mask), ``dense`` (no mask at all) and
``decode`` (a decode-shaped call, L <= 16). Which one is faster depends on the dtype and on what
the CPU multiplies that dtype with: torch's bfloat16 SDPA runs on AMX tiles where the CPU has
them (several times attnkit's AVX512-BF16 dot products), while on a CPU without bf16 instructions
it is slower than its own float32. So ``auto`` reads one :class:`Rule` per (dtype, instruction
set class) from :data:`RULES`, each measured on a CPU of that class and recorded with the
command that measured it and its figures; a class nobody has measured does what torch does
(SDPA). A rule is never carried over from another class.

Mask specs (windows, documents, padding, ...) are not ruled here: SDPA would need the L x S mask
materialised, and attnkit's kernels, which visit only the keys each row may see, were faster on
every class measured (on AMX too: the bf16 causal window 1024 at L=8192, 241 ms against SDPA's
602 ms with the dense mask); the blocked backend's own size rule decides them.

:func:`isa_class` names a CPU's class for a dtype from its ``/proc/cpuinfo`` flags
(:func:`attnkit.cpu.features`, which tests replace to simulate other CPUs); :func:`select` is
the one question the blocked backend asks, and its answer's words are what
:func:`attnkit.explain` prints for auto's choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from attnkit import cpu
from attnkit.cpu import CpuFeatures

__all__ = ["KINDS", "RULES", "Kind", "Rule", "isa_class", "rule_for", "select"]

Kind = Literal["causal", "dense", "decode"]
#: the calls a rule decides: where torch's SDPA runs without a mask tensor
KINDS: tuple[Kind, ...] = ("causal", "dense", "decode")

_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl"})
_AVX2 = frozenset({"avx2", "fma"})

#: per dtype: the instruction set classes, most capable first, and the flags each needs
_CLASSES: dict[torch.dtype, tuple[tuple[str, frozenset[str]], ...]] = {
    torch.bfloat16: (
        ("amx-bf16", frozenset({"amx_bf16"})),
        ("avx512-bf16", _AVX512 | {"avx512_bf16"}),
        ("avx512", _AVX512),
        ("avx2", _AVX2),
    ),
    torch.float16: (
        ("amx-fp16", frozenset({"amx_fp16"})),
        ("avx512-fp16", _AVX512 | {"avx512_fp16"}),
        ("avx512", _AVX512),
        ("avx2", _AVX2),
    ),
    torch.float32: (
        ("avx512", _AVX512),
        ("avx2", _AVX2),
    ),
}


@dataclass(frozen=True)
class Rule:
    """What ``auto`` does for ``dtype`` on CPUs of class ``isa``: the kinds of call attnkit's
    kernels take (``attnkit``; SDPA takes the others), the CPU that measured it (``host``),
    the command (``benchmark``) and what it printed (``figures``, attnkit against SDPA)."""

    dtype: torch.dtype
    isa: str
    attnkit: frozenset[Kind]
    host: str
    benchmark: str
    figures: str

    @property
    def name(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} on {self.isa}"

    def takes(self, kind: Kind) -> bool:
        return kind in self.attnkit

    def describe(self, kind: Kind) -> str:
        """The rule in explain's words, for a call of ``kind``."""
        who = "attnkit's kernel" if self.takes(kind) else "torch's SDPA"
        return (
            f"measured rule '{self.name}' ({kind} calls: {who}; {self.figures}; "
            f"{self.host}; {self.benchmark})"
        )


_LP = "python benchmarks/low_precision.py --reps 5"
_BENCH = "attnkit bench (docs/benchmarks.md)"
_RULE_BENCH = "python benchmarks/cpu_rules.py"
#: the rows measured on a host with AMX against SDPA, compiled flex and vLLM's CPU kernel, as a
#: user calls them (the figures in docs/low_precision.md's table)
_PEER_TABLE = "bf16/fp16 rows against SDPA, flex and vLLM (ms, medians of 5 interleaved rounds)"
_ALL: frozenset[Kind] = frozenset(KINDS)

#: every rule measured, one per (dtype, class); docs/low_precision.md has their tables
RULES: tuple[Rule, ...] = (
    Rule(
        torch.float32, "avx2", _ALL, "AMD EPYC, AVX2 only, 2 threads",
        "benchmarks/kernel_spans.py, benchmarks/decode_kernel.py",
        "causal 1.2-1.6x SDPA forward, 1.1-1.3x forward + backward; dense and decode faster",
    ),
    Rule(
        torch.float32, "avx512", _ALL,
        "Intel Xeon model 207 (AVX-512) and AMD EPYC Zen 4 (AVX-512, avx512_bf16), 2 threads",
        f"python benchmarks/decode.py (Xeon); {_RULE_BENCH} --dtype float32 (EPYC)",
        "Xeon: dense prefill 1.12-1.19x SDPA, decode 2.4x; EPYC: dense 1.4x, causal 1.35-1.5x, "
        "causal training 1.6x, decode 1.8x",
    ),
    Rule(
        torch.bfloat16, "avx2", _ALL, "AMD EPYC, AVX2 only, 2 threads", _BENCH,
        "causal L=4096 forward 1.39x SDPA bf16; fp32-upcast path",
    ),
    Rule(
        torch.bfloat16, "avx512", _ALL,
        "Intel Xeon model 207, AVX-512 without BF16, 2 threads", _BENCH,
        "decode step 14.1x SDPA bf16 (SDPA's bf16 without bf16 instructions); fp32-upcast path",
    ),
    Rule(
        torch.bfloat16, "avx512-bf16", _ALL,
        "AMD EPYC (Zen 4), avx512_bf16, no AMX, 2 threads", _RULE_BENCH,
        "dense 2.2x, causal 2.6-3.4x, causal training 2.4x, decode 4.0x SDPA bf16",
    ),
    Rule(
        torch.bfloat16, "amx-bf16", frozenset({"decode"}),
        "Intel Xeon model 207 with amx_bf16, 2 threads", _PEER_TABLE,
        "dense 0.28x, causal GQA 0.19x, causal training 0.67x, decode 1.89x SDPA bf16: "
        "torch's SDPA runs on AMX tiles, attnkit's kernel on AVX512-BF16 dot products",
    ),
    Rule(
        torch.float16, "avx512-fp16", frozenset(),
        "Intel Xeon model 207 with avx512_fp16, no AMX-FP16, 2 threads", _PEER_TABLE,
        "causal 0.81x SDPA fp16",
    ),
    Rule(
        torch.float16, "avx512", _ALL,
        "AMD EPYC (Zen 4), AVX-512 without FP16, 2 threads", _RULE_BENCH,
        "dense 2.0-2.3x, causal 1.7-2.9x, causal training 11x, decode 5-10x SDPA fp16 "
        "(fp32-upcast path, F16C conversions)",
    ),
)  # fmt: skip

_BY_KEY = {(r.dtype, r.isa): r for r in RULES}


def isa_class(dtype: torch.dtype, feats: CpuFeatures | None = None) -> str | None:
    """The instruction set class of this CPU (or ``feats``) for ``dtype``: the most capable of
    :data:`_CLASSES` whose flags it has (``amx-bf16``, ``avx512-bf16``, ``avx512``, ``avx2``
    for bfloat16, ...); ``None`` for another dtype, a CPU that is not x86, or one below AVX2."""
    f = cpu.features() if feats is None else feats
    if not f.x86:
        return None
    for name, need in _CLASSES.get(dtype, ()):
        if need <= f.flags:
            return name
    return None


def rule_for(dtype: torch.dtype, feats: CpuFeatures | None = None) -> Rule | None:
    """The measured rule for ``dtype`` on this CPU (or ``feats``), or ``None`` where nobody
    measured its class."""
    isa = isa_class(dtype, feats)
    return None if isa is None else _BY_KEY.get((dtype, isa))


def select(dtype: torch.dtype, kind: Kind, feats: CpuFeatures | None = None) -> tuple[bool, str]:
    """``(attnkit, why)``: whether auto gives a CPU call of ``kind`` in ``dtype`` to attnkit's
    kernel (True) or to torch's SDPA (False), and the rule's words. A class without a measured
    rule does what torch does: SDPA."""
    rule = rule_for(dtype, feats)
    if rule is not None:
        return rule.takes(kind), rule.describe(kind)
    isa = isa_class(dtype, feats) or "this CPU"
    name = str(dtype).removeprefix("torch.")
    return False, (
        f"no measured rule for {name} on {isa}: auto does what torch does (SDPA) for "
        f"{kind} calls (attnkit.backends.blocked.measured)"
    )
