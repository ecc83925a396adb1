"""Compiling attnkit's C++ kernels here, the fallback where the wheel's prebuilt build does not
serve (an sdist or editable install, an edited source, a CPU without F16C): one build directory
per (source, flags, Python environment), guarded by a lock that cannot outlive its holder.

The kernels are plain C ABI libraries (:mod:`~attnkit.backends.blocked.builds`: no torch header,
no libtorch symbol), compiled with the system's C++ compiler (``CXX``, else ``c++``/``g++``/
``clang++`` on ``PATH``) into ``<cache>/<name>-<hash>/<name>.so``, the hash over everything the
build reads (:func:`build_dir`), so that environments never share one; :func:`exclusive` takes an
``fcntl.flock`` on a file beside it while the build runs. The kernel releases a flock when its
holder dies, however it dies, so a waiter waits only for a builder that is alive, and at most
``ATTNKIT_KERNEL_BUILD_WAIT`` seconds (the kernel then runs without its build, saying why). A
torch ``lock`` file found there (left by a ``load_inline`` builder of an older attnkit that died)
is removed.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from attnkit.backends.blocked import builds

__all__ = ["CACHE_ENV", "WAIT_ENV", "build_dir", "exclusive", "load", "load_or_why"]

#: where the builds go (default ``~/.cache/attnkit/kernels``)
CACHE_ENV = "ATTNKIT_KERNEL_CACHE"
#: how many seconds to wait for another live process's build of the same kernel (default 900)
WAIT_ENV = "ATTNKIT_KERNEL_BUILD_WAIT"
#: torch's own lock file inside a build directory (``torch.utils.file_baton.FileBaton``)
TORCH_LOCK = "lock"


def _root() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnkit" / "kernels"


def build_dir(name: str, source: str, cflags: list[str], ldflags: list[str]) -> Path:
    """The directory of one build: ``<cache>/<name>-<hash>``, the hash over the source, the
    flags and the Python environment (its prefix and version), all a build depends on (not
    torch's version: the kernels use no part of torch's)."""
    h = hashlib.sha256()
    for part in (source, *cflags, "|", *ldflags, sys.prefix, sys.version):
        h.update(part.encode())
        h.update(b"\0")
    return _root() / f"{name}-{h.hexdigest()[:16]}"


def _wait_seconds() -> float:
    raw = os.environ.get(WAIT_ENV, "900")
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{WAIT_ENV}={raw!r} is not a number of seconds") from None


@contextmanager
def exclusive(directory: Path, wait: float | None = None) -> Iterator[None]:
    """Hold ``<directory>.flock`` (created as needed) while the block runs; a torch ``lock``
    file inside ``directory`` found then is stale and is removed. Waits at most ``wait``
    seconds (default :data:`WAIT_ENV`) for another process holding it, then raises
    ``TimeoutError`` naming the file."""
    import fcntl

    wait = _wait_seconds() if wait is None else wait
    directory.parent.mkdir(parents=True, exist_ok=True)
    path = directory.with_name(directory.name + ".flock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another process has held {path} for more than {wait:.0f} s while it "
                        f"builds the kernel (set {WAIT_ENV} to wait longer)"
                    ) from None
                time.sleep(0.2)
        stale = directory / TORCH_LOCK
        if stale.exists():
            stale.unlink()
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def load(build: builds.Build) -> Path:
    """Compile ``build`` (or find its earlier compile) in its own :func:`build_dir`, under
    :func:`exclusive`; returns the library's path."""
    source = builds.source_text(build.csrc)
    directory = build_dir(build.name, source, [*builds.COMMON, *build.flags], list(builds.LINK))
    with exclusive(directory):
        out = directory / f"{build.name}.so"
        if not out.exists():
            builds.compile_to(build, directory)
        return out


def load_or_why(build: builds.Build) -> tuple[Path | None, str | None, float | None]:
    """:func:`load`: ``(path, None, seconds)``, or ``(None, why, None)`` where it cannot be
    built (no compiler, a failed build, a build lock held too long), in the words ``status()``
    lines print."""
    try:
        t0 = time.perf_counter()
        path = load(build)
        return path, None, time.perf_counter() - t0
    except Exception as e:  # say so, run without
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return None, f"it could not be built ({type(e).__name__}: {first[:200]})", None
