"""The kernel build's cache and lock (attnkit.backends.blocked.jit): a builder that died never
makes a later load wait, a live one is waited for a bounded time, and environments never
share a build."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from attnkit.backends.blocked import builds, jit, native, rowspan_builds


def test_a_lock_file_left_by_a_killed_builder_is_removed(tmp_path: Path) -> None:
    build = tmp_path / "k-0123"
    build.mkdir()
    (build / jit.TORCH_LOCK).touch()  # what torch's FileBaton leaves when its holder dies
    with jit.exclusive(build, wait=1.0):
        assert not (build / jit.TORCH_LOCK).exists()
    assert (tmp_path / "k-0123.flock").exists()


def _hold(path: Path, started: Path) -> subprocess.Popen[bytes]:
    """A process that takes the flock and sleeps, like a builder in the middle of a build."""
    code = textwrap.dedent(f"""
        from pathlib import Path
        import time
        from attnkit.backends.blocked import jit
        with jit.exclusive(Path({str(path)!r}), wait=5):
            Path({str(started)!r}).touch()
            time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not started.exists():
        assert proc.poll() is None, "the holder exited early"
        assert time.monotonic() < deadline, "the holder never took the lock"
        time.sleep(0.05)
    return proc


def test_a_live_builder_is_waited_for_a_bounded_time_and_a_killed_one_not_at_all(
    tmp_path: Path,
) -> None:
    build = tmp_path / "k-4567"
    holder = _hold(build, tmp_path / "started")
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as e, jit.exclusive(build, wait=0.5):
            pass
        assert time.monotonic() - t0 < 30
        assert str(build) + ".flock" in str(e.value)
        assert jit.WAIT_ENV in str(e.value)
    finally:
        holder.kill()  # SIGKILL: no cleanup runs, as when a session ends mid-build
        holder.wait()
    t0 = time.monotonic()
    with jit.exclusive(build, wait=5.0):
        pass
    assert time.monotonic() - t0 < 5  # the kernel released the dead holder's lock


def test_a_build_wait_that_is_not_a_number_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(jit.WAIT_ENV, "ten")
    with pytest.raises(ValueError, match=f"{jit.WAIT_ENV}='ten' is not a number of seconds"):
        jit._wait_seconds()


def test_each_source_flag_and_environment_gets_its_own_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(jit.CACHE_ENV, str(tmp_path))
    one = jit.build_dir("k", "int f();", ["-O3"], [])
    assert one.parent == tmp_path
    assert one.name.startswith("k-")
    assert jit.build_dir("k", "int f();", ["-O3"], []) == one
    assert jit.build_dir("k", "int g();", ["-O3"], []) != one
    assert jit.build_dir("k", "int f();", ["-O2"], []) != one
    monkeypatch.setattr(sys, "prefix", "/another/venv")
    assert jit.build_dir("k", "int f();", ["-O3"], []) != one


def test_the_row_span_kernel_loads_past_a_stale_lock_in_its_build_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not rowspan_builds.available():
        pytest.skip(rowspan_builds.status())
    monkeypatch.setenv(native.ENV, "compile")  # the build compiled here, not the package's
    kernel, why = native.load(builds.ROW_SPAN, native.SpanKernel)
    assert kernel is not None, why
    directory = Path(kernel.__file__).parent  # the build this environment compiles
    assert directory.parent == jit._root()
    with jit.exclusive(directory, wait=600):
        (directory / jit.TORCH_LOCK).touch()  # left there as a killed builder leaves it
    code = (
        "from attnkit.backends.blocked import rowspan_builds as r; print(r.status()); "
        "print(r.kernel().__file__)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True
    )
    assert run.stdout.split("\n")[1] == kernel.__file__
    assert run.stdout.startswith("attnkit's A")  # AVX2 or AVX-512: status() names the build
    assert not (directory / jit.TORCH_LOCK).exists()
