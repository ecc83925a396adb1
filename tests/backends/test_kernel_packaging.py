"""Where attnkit's C++ kernels come from (attnkit.backends.blocked.native, builds): the package's
prebuilt file where its fingerprint matches the sources, else a build compiled here, else
none, said why, and the call still runs; and the kernels use no part of libtorch, so that one
build serves every torch version (the wheel itself: ``make wheel-check``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attnkit.backends.blocked import builds, decode, native, rowspan_builds


@pytest.fixture
def fresh_manifest() -> object:
    native._manifest.cache_clear()
    yield
    native._manifest.cache_clear()


def _fake_prebuilt(tmp_path: Path, build: builds.Build, fingerprint: str) -> Path:
    folder = tmp_path / builds.PREBUILT
    folder.mkdir(parents=True)
    (folder / f"{build.name}.so").write_bytes(b"not a library")
    entry = {"file": f"{build.name}.so", "fingerprint": fingerprint, "isa": build.isa}
    manifest = {"abi": builds.ABI, "builds": {build.name: entry}}
    (folder / builds.MANIFEST).write_text(json.dumps(manifest))
    return folder


@pytest.mark.usefixtures("fresh_manifest")
def test_a_prebuilt_kernel_serves_only_the_sources_it_was_built_from(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    build = builds.ROW_SPAN
    folder = _fake_prebuilt(tmp_path, build, builds.fingerprint(build))
    monkeypatch.setattr(native, "prebuilt_dir", lambda: folder)
    monkeypatch.delenv(native.ENV, raising=False)
    assert native.prebuilt(build) == (folder / f"{build.name}.so", "")
    monkeypatch.setenv(native.ENV, "compile")
    assert native.prebuilt(build) == (None, f"{native.ENV}=compile")
    monkeypatch.delenv(native.ENV)
    native._manifest.cache_clear()
    stale = _fake_prebuilt(tmp_path / "old", build, "0" * 20)
    monkeypatch.setattr(native, "prebuilt_dir", lambda: stale)
    assert native.prebuilt(build) == (
        None,
        "the kernel's source differs from the prebuilt build's (edited since)",
    )
    assert native.prebuilt(builds.DECODE) == (  # not in that manifest
        None,
        "the package was built without attnkit_decode_avx2 (its compiler failed)",
    )


def test_each_build_has_its_own_fingerprint(tmp_path: Path) -> None:
    prints = {builds.fingerprint(b) for b in builds.ALL}
    assert len(prints) == len(builds.ALL)
    files = builds.parts("row_span.cpp")
    assert files[:3] == (*builds.HEADERS, "row_span.cpp")
    assert "row_span_fp32_avx512.h" in files  # each instruction set's micro-kernels: a part
    for name in files:
        shutil.copy(builds.CSRC / name, tmp_path / name)
    assert builds.fingerprint(builds.ROW_SPAN, tmp_path) == builds.fingerprint(builds.ROW_SPAN)
    for name in ("row_span.cpp", "row_span_bf16dot.h"):  # an edit of the source or of a part
        before = builds.fingerprint(builds.ROW_SPAN, tmp_path)
        with (tmp_path / name).open("a") as f:
            f.write("\n// an edit\n")
        assert builds.fingerprint(builds.ROW_SPAN, tmp_path) != before
    text = builds.source_text("row_span.cpp")
    assert '#include "row_span_' not in text  # one translation unit, the parts in place
    assert "static void forward_impl(" in text
    assert builds.ROW_SPAN.without_f16c().flags == ("-mavx2", "-mfma")


@pytest.mark.usefixtures("fresh_manifest")
def test_prebuilt_only_never_compiles_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if rowspan_builds.cpu_reason() is not None:
        pytest.skip(rowspan_builds.cpu_reason())
    monkeypatch.setattr(native, "prebuilt_dir", lambda: tmp_path / "none")
    monkeypatch.setenv(native.ENV, "prebuilt")
    monkeypatch.setenv("ATTNKIT_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="attnkit_decode_avx2 kernel is unavailable"):
        kernel, why = native.load(builds.DECODE, native.DecodeKernel)
    assert kernel is None
    assert why == (
        f"no prebuilt kernel serves (no prebuilt kernels in this install ({tmp_path / 'none'} "
        f"has no manifest.json)) and {native.ENV}=prebuilt"
    )
    assert not (tmp_path / "cache").exists()
    monkeypatch.setenv(native.ENV, "always")
    assert native.load(builds.DECODE, native.DecodeKernel) == (
        None,
        f"{native.ENV}='always': expected one of auto, prebuilt, compile",
    )


def _loaded() -> list[native.Library]:
    rows = (e.lazy.get() for e in rowspan_builds.TABLE) if rowspan_builds.available() else ()
    found = [m for m in (*rows, decode.build()) if m is not None]
    if not found:
        pytest.skip(rowspan_builds.status())
    return found


def test_the_kernels_use_no_part_of_libtorch_or_python() -> None:
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump here to read the kernels' dynamic sections")
    for kernel in _loaded():
        head = subprocess.run([objdump, "-p", kernel.__file__], capture_output=True, text=True)
        needed = [ln.split()[1] for ln in head.stdout.splitlines() if "NEEDED" in ln]
        assert "libgomp.so.1" in needed  # torch's OpenMP runtime, found by its soname
        assert not [n for n in needed if "torch" in n or "c10" in n or "python" in n], needed
        syms = subprocess.run([objdump, "-T", kernel.__file__], capture_output=True, text=True)
        undefined = [ln.split()[-1] for ln in syms.stdout.splitlines() if "*UND*" in ln]
        assert undefined
        assert not [s for s in undefined if s.startswith(("_ZN3c10", "_ZN2at", "_ZN5torch", "Py"))]


def test_the_kernels_share_torchs_openmp_runtime() -> None:
    _loaded()
    code = textwrap.dedent(
        """
        import json, os, torch
        from attnkit.backends.blocked import decode, rowspan_builds
        assert rowspan_builds.available() and decode.build() is not None
        with open("/proc/self/maps") as f:
            found = {ln.split()[-1] for ln in f if "libgomp" in ln or "libiomp" in ln}
        print(json.dumps({"found": sorted(found), "torch": os.path.dirname(torch.__file__)}))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True
    )
    seen = json.loads(run.stdout)
    runtimes = seen["found"]
    assert len(runtimes) == 1, runtimes  # one thread team: torch's, as at::parallel_for uses
    assert runtimes[0].startswith(seen["torch"])


def test_a_kernel_reports_a_refusal_as_an_error() -> None:
    kernel = decode.build() or pytest.skip(decode.status())
    import torch

    q = torch.randn(1, 4, 1, 8)
    k = torch.randn(1, 3, 16, 8)  # 4 query heads over 3 key/value heads
    lo, hi = torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), 15)
    runs = decode.DecodePlan(lo, hi, "runs", None)
    with pytest.raises(RuntimeError, match="decode: shapes of q, k, v do not match"):
        kernel.decode_forward(q, k, k, runs, 0.5)
    kt = torch.randn(1, 2, 8, 16).transpose(2, 3)  # (1, 2, 16, 8), last dim strided
    with pytest.raises(RuntimeError, match="decode: k and v need a contiguous last dim"):
        kernel.decode_forward(q, kt, kt.contiguous(), runs, 0.5)


def test_a_bound_decode_call_gives_the_checked_calls_bits() -> None:
    kernel = decode.build() or pytest.skip(decode.status())
    import torch

    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(2, 8, 3, 64, dtype=dtype).transpose(1, 2).contiguous().transpose(1, 2)
        cache = torch.randn(2, 2, 40, 64, dtype=dtype)
        k, v = cache[:, :, :33], cache[:, :, 5:38]  # strided views of a cache buffer
        lo = torch.tensor([[0, 0, 1], [3, 4, 5]])
        hi = torch.tensor([[30, 31, 32], [30, 31, 32]])
        runs = decode.DecodePlan(lo, hi, "runs", None)
        bound = kernel.bind(q, k, v, runs, 0.3)
        for _ in range(2):
            q2, k2, v2 = torch.randn_like(q), torch.randn_like(cache), torch.randn_like(cache)
            out = bound(q2, k2[:, :, :33], v2[:, :, 5:38])
            want, _, ok = kernel.decode_forward(q2, k2[:, :, :33], v2[:, :, 5:38], runs, 0.3)
            assert ok is True
            assert out is not None
            assert torch.equal(out, want)
        q2[0, 0, 0, 0] = float("nan")
        assert kernel.decode_forward(q2, k2[:, :, :33], v2[:, :, 5:38], runs, 0.3)[2] is False
        assert bound(q2, k2[:, :, :33], v2[:, :, 5:38]) is None
    with pytest.raises(RuntimeError, match="decode: shapes of q, k, v do not match"):
        kernel.bind(q[:, :5], k, v, runs, 0.3)


NO_KERNEL = textwrap.dedent(
    """
    import torch, attnkit
    from attnkit import masks
    from attnkit.backends.blocked import rowspan_builds, decode
    from attnkit.cli.doctor import _span_kernel
    torch.manual_seed(0)
    q = torch.randn(2, 4, 300, 16, requires_grad=True)
    k = torch.randn(2, 2, 300, 16, requires_grad=True)
    mask = masks.causal() & masks.sliding_window(64)
    out = attnkit.attention(q, k, k, mask=mask)
    out.sum().backward()
    ref = torch.softmax(
        (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) / 4).masked_fill(
            ~mask.to_dense(300, 300), float("-inf")), -1) @ k.double().repeat_interleave(2, 1)
    print((out.double() - ref).abs().max().item() < 1e-5, k.grad is not None)
    ob = attnkit.attention(q.detach().bfloat16(), k.detach().bfloat16(), k.detach().bfloat16(),
                           mask=mask)
    od = attnkit.attention(q.detach()[:, :, :1], k.detach(), k.detach(), causal=True)
    print(ob.dtype, od.shape)
    print(rowspan_builds.status())
    print(decode.status())
    print(attnkit.explain(q, k, k, mask=mask).notes["blocked"])
    print(dict(_span_kernel())["span kernel"])
    """
)


def test_without_prebuilt_kernels_or_a_compiler_attnkit_says_why_and_runs(
    tmp_path: Path,
) -> None:
    if rowspan_builds.cpu_reason() is not None:
        pytest.skip(rowspan_builds.cpu_reason())
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC")}
    env |= {
        "PATH": str(tmp_path),  # no compiler
        native.ENV: "compile",  # as an install without prebuilt kernels
        "ATTNKIT_KERNEL_CACHE": str(tmp_path / "cache"),
    }
    run = subprocess.run(
        [sys.executable, "-c", NO_KERNEL], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[:2] == ["True True", "torch.bfloat16 torch.Size([2, 4, 1, 16])"]
    why = (
        "it could not be built (FileNotFoundError: no C++ compiler on PATH (c++, g++, clang++; "
        f"or set CXX)); no prebuilt kernel serves ({native.ENV}=compile)"
    )
    assert lines[2] == f"torch's fused kernel (attnkit's row-span kernel is off: {why})"
    assert lines[3] == f"attnkit's decode kernel is off: {why}"
    assert why in lines[4]  # explain says why the kernel does not run the call
    assert lines[5] == lines[2]  # and so does attnkit doctor
    assert not list((tmp_path / "cache").glob("*/*.so"))
    warned = [ln for ln in run.stderr.splitlines() if "RuntimeWarning" in ln]
    assert len(warned) == 2  # said once for each kernel (row-span, decode), not per call
    assert "attnkit's attnkit_row_span_avx2 kernel is unavailable: " + why in warned[0]
