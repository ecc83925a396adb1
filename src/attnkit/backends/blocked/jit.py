"""Building attnkit's C++ kernels on first use: one build directory per (source, flags, torch,
Python environment), guarded by a lock that cannot outlive its holder.

:func:`torch.utils.cpp_extension.load_inline` on its own builds into one directory per module
name under ``~/.cache/torch_extensions``, shared by every checkout and virtualenv on the
machine, and guards it with a ``lock`` *file* that a builder deletes when it is done. Two
failures follow from that, both seen here: another environment's build (other include paths)
forces a rebuild that bumps the module's version and evicts the first; and a builder that is
killed mid-build (a session's end, Ctrl-C, an out-of-memory kill) leaves the file behind, so
that every later load waits for it forever, a CI run included.

Here each build gets its own directory, named by a hash of everything the build reads
(:func:`build_dir`), so that environments never share one; and :func:`exclusive` takes an
``fcntl.flock`` on a file beside it before torch looks at it. The kernel releases a flock when
its holder dies, however it dies, so a waiter waits only for a builder that is alive, and at
most ``ATTNKIT_KERNEL_BUILD_WAIT`` seconds (the kernel then runs without its build, saying
why). Every builder of the directory holds the flock, so a torch ``lock`` file found while
holding it was left by a builder that died: it is removed.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import torch

__all__ = ["CACHE_ENV", "WAIT_ENV", "build_dir", "exclusive", "load", "load_or_why"]

#: where the builds go (default ``~/.cache/attnkit/kernels``)
CACHE_ENV = "ATTNKIT_KERNEL_CACHE"
#: how many seconds to wait for another live process's build of the same kernel (default 900)
WAIT_ENV = "ATTNKIT_KERNEL_BUILD_WAIT"
#: the header of element types and loads every kernel source starts with (``csrc/``)
ELEMENTS = "elements.h"
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
    flags, torch's version and the Python environment (its prefix and version), all a build
    depends on."""
    h = hashlib.sha256()
    for part in (source, *cflags, "|", *ldflags, torch.__version__, sys.prefix, sys.version):
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


def load(
    name: str, source: str, functions: list[str], cflags: list[str], ldflags: list[str]
) -> Any:
    """Build (or load the cached build of) a C++ source with ``load_inline`` into its own
    :func:`build_dir`, under :func:`exclusive`."""
    from torch.utils.cpp_extension import load_inline

    directory = build_dir(name, source, cflags, ldflags)
    with exclusive(directory):
        directory.mkdir(parents=True, exist_ok=True)
        return load_inline(  # type: ignore[no-untyped-call]
            name=name,
            cpp_sources=[source],
            functions=functions,
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            build_directory=str(directory),
            no_implicit_headers=True,
            with_pytorch_error_handling=False,
            verbose=False,
        )


def load_or_why(
    name: str, csrc: str, functions: list[str], cflags: list[str], ldflags: list[str]
) -> tuple[Any, str | None, float | None]:
    """:func:`load` of ``csrc/<csrc>`` (beside this module) after :data:`ELEMENTS`' text:
    ``(module, None, seconds)``, or
    ``(None, why, None)`` where it cannot be built (no compiler, no ninja, a failed build, a
    build lock held too long), in the words ``status()`` lines print."""
    try:
        here = resources.files("attnkit.backends.blocked").joinpath("csrc")
        source = "\n".join(here.joinpath(f).read_text() for f in (ELEMENTS, csrc))
        t0 = time.perf_counter()
        module = load(name, source, functions, cflags, ldflags)
        return module, None, time.perf_counter() - t0
    except Exception as e:  # say so, run without
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return None, f"it could not be built ({type(e).__name__}: {first[:200]})", None
