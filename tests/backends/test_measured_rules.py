"""auto's measured CPU rules (attnkit.backends.blocked.measured): one rule per dtype and
instruction set class, applied to plain causal, unmasked and decode calls; a class nobody
measured does what torch does (SDPA); explain names the rule that chose. Other CPUs are
simulated by replacing :func:`attnkit.cpu.features` (the kernels still run on this CPU's own
instructions: :func:`attnkit.cpu.hardware_flags`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

import attnkit
from attnkit import cpu, masks
from attnkit.backends import memo
from attnkit.backends.blocked import decode, measured, rowspan_builds
from attnkit.cpu import CpuFeatures

AVX512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}


def _cpu(*flags: str, machine: str = "x86_64") -> CpuFeatures:
    return CpuFeatures(machine, frozenset(flags), "AVX512")


@pytest.fixture(autouse=True)
def _fresh_decisions() -> Iterator[None]:
    memo.clear()  # a kept decision was made for the CPU of its time
    yield
    memo.clear()


def _simulate(monkeypatch: pytest.MonkeyPatch, *extra: str) -> None:
    f = cpu.features()
    fake = dataclasses.replace(f, flags=f.flags | set(extra))
    monkeypatch.setattr(cpu, "features", lambda: fake)


@pytest.mark.parametrize(
    ("dtype", "flags", "want"),
    [
        (torch.bfloat16, (*AVX512, "avx512_bf16", "amx_bf16"), "amx-bf16"),
        (torch.bfloat16, (*AVX512, "avx512_bf16"), "avx512-bf16"),
        (torch.bfloat16, tuple(AVX512), "avx512"),
        (torch.bfloat16, ("avx2", "fma"), "avx2"),
        (torch.bfloat16, ("sse4_2",), None),
        (torch.float16, (*AVX512, "avx512_fp16"), "avx512-fp16"),
        (torch.float16, (*AVX512, "avx512_fp16", "amx_fp16"), "amx-fp16"),
        (torch.float16, (*AVX512, "avx512_bf16"), "avx512"),
        (torch.float32, (*AVX512, "amx_bf16"), "avx512"),
        (torch.float32, ("avx2", "fma"), "avx2"),
        (torch.float64, tuple(AVX512), None),
    ],
)
def test_a_cpu_s_class_is_the_most_capable_it_has_the_flags_for(
    dtype: torch.dtype, flags: tuple[str, ...], want: str | None
) -> None:
    assert measured.isa_class(dtype, _cpu(*flags)) == want


def test_a_cpu_that_is_not_x86_has_no_class_and_auto_does_what_torch_does() -> None:
    arm = _cpu("avx2", "fma", machine="aarch64")
    assert measured.isa_class(torch.float32, arm) is None
    takes, why = measured.select(torch.float32, "causal", arm)
    assert not takes
    assert why.startswith("no measured rule for float32 on this CPU: auto does what torch does")


def test_every_rule_is_one_of_a_kind_and_says_where_it_was_measured() -> None:
    keys = [(r.dtype, r.isa) for r in measured.RULES]
    assert len(keys) == len(set(keys))
    for rule in measured.RULES:
        classes = [name for name, _ in measured._CLASSES[rule.dtype]]
        assert rule.isa in classes, rule
        assert rule.host, rule
        assert rule.benchmark, rule
        assert rule.figures, rule
        assert rule.attnkit <= set(measured.KINDS), rule
        for kind in measured.KINDS:
            words = rule.describe(kind)
            assert words.startswith(f"measured rule '{rule.name}' ({kind} calls: ")
            assert rule.host in words
            assert rule.figures in words


def test_amx_sends_bf16_causal_and_dense_to_sdpa_but_keeps_decode() -> None:
    amx = _cpu(*AVX512, "avx512_bf16", "amx_bf16")
    assert measured.select(torch.bfloat16, "causal", amx)[0] is False
    assert measured.select(torch.bfloat16, "dense", amx)[0] is False
    assert measured.select(torch.bfloat16, "decode", amx)[0] is True
    fp16 = _cpu(*AVX512, "avx512_fp16")
    assert not any(measured.select(torch.float16, k, fp16)[0] for k in measured.KINDS)


def test_an_unmeasured_class_does_what_torch_does() -> None:
    amx_fp16 = _cpu(*AVX512, "avx512_fp16", "amx_fp16")
    takes, why = measured.select(torch.float16, "decode", amx_fp16)
    assert not takes
    assert why.startswith("no measured rule for float16 on amx-fp16: auto does what torch does")


needs_kernel = pytest.mark.skipif(
    not rowspan_builds.available(),
    reason=f"the row-span kernel does not run here: {rowspan_builds.status()}",
)
needs_bf16 = pytest.mark.skipif(
    cpu.unavailable("native", torch.bfloat16) is not None
    and cpu.unavailable("fp32-upcast", torch.bfloat16) is not None,
    reason="no CPU path of attnkit's own runs bfloat16 here (neither avx512_bf16 nor AVX2)",
)


def _bf16(L: int, S: int, H: int = 8, Hkv: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, L, 32, generator=g).bfloat16()
    k = torch.randn(1, Hkv, S, 32, generator=g).bfloat16()
    return q, k, torch.randn(1, Hkv, S, 32, generator=g).bfloat16()


@needs_kernel
@needs_bf16
def test_on_a_simulated_amx_cpu_auto_runs_bf16_causal_on_sdpa_and_explain_names_the_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _simulate(monkeypatch, "avx512_bf16", "amx_bf16")
    monkeypatch.delenv(cpu.ENV, raising=False)
    q, k, v = _bf16(1024, 1024)
    report = attnkit.explain(q, k, v, causal=True)
    assert report.chosen == "sdpa"
    # the rule decides where the AVX512-BF16 build runs here; on a CPU without it (AVX2 only)
    # the missing build decides first, and explain says that instead
    kernel, why = rowspan_builds.select(torch.bfloat16, in_dtype=True, dot=True)
    rule = "blocked's rule: torch's SDPA is faster here, by measured rule 'bfloat16 on amx-bf16'"
    assert (rule if kernel is not None else why) in report.rule
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(attnkit.attention(q, k, v, causal=True), want, atol=0, rtol=0)
    # a mask spec stays on blocked: SDPA would need the L x S mask materialised
    window = masks.causal() & masks.sliding_window(128)
    assert attnkit.explain(q, k, v, mask=window).chosen == "blocked"


@needs_kernel
@needs_bf16
def test_on_a_simulated_amx_cpu_a_bf16_decode_step_keeps_attnkit_s_decode_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not decode.available():
        pytest.skip(f"the decode kernel does not run here: {decode.status()}")
    _simulate(monkeypatch, "avx512_bf16", "amx_bf16")
    q, k, v = _bf16(1, 2048)
    report = attnkit.explain(q, k, v)
    assert report.chosen == "blocked"
    assert "measured rule 'bfloat16 on amx-bf16' (decode calls: attnkit's kernel" in report.rule


@needs_kernel
@needs_bf16
def test_on_this_cpu_auto_follows_its_own_measured_rule() -> None:
    q, k, v = _bf16(1024, 1024)
    takes, why = measured.select(torch.bfloat16, "causal")
    report = attnkit.explain(q, k, v, causal=True)
    assert report.chosen == ("blocked" if takes else "sdpa")
    assert why in report.rule
