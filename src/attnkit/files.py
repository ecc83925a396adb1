"""Every file attnkit writes is written here, one way: never through a link, never half.

A file is written to a new temporary file in its own directory (``.<name>.<random>.tmp``,
created with ``O_EXCL``, so nothing planted there is followed), flushed to disk with
``fsync``, then moved over the final name with :func:`os.replace`. So:

- **A symbolic link at the final name is replaced, never followed**: the file it points to is
  left as it was, and the link becomes the new regular file. A marker-editing writer (the bench's
  markdown report) reads the file it edits only when it is a regular file, never through a link.
- **An interrupted or failed write leaves the previous file intact**, and its temporary file is
  removed (on any exception, Ctrl-C included; only a killed process leaves one behind).
- **A file gets the permissions a plain ``open(path, "w")`` would give it**: those of the file
  it replaces when this user owns that one, else ``0o666`` less the umask (not ``mkstemp``'s
  ``0o600``). An existing file this user may not write (read-only) is refused, not replaced.
- **A failure is one :class:`WriteError`** (an :class:`~attnkit.AttentionInputError`, so one
  line and exit code 2 on the command line) that says which file and that the previous one is
  intact: ``no space left on device while writing run/checkpoint.safetensors; the previous
  checkpoint is intact.`` for a full disk (``ENOSPC``; ``EDQUOT`` for a quota), ``cannot write
  ...`` with the system's reason otherwise.

**Directories.** The directory a file goes into may be reached through symbolic links the user
made (``out -> /scratch/out`` is common), so links on the way are followed, with the rule
Linux's ``fs.protected_symlinks`` applies in shared directories: a link is followed only when
this user, root, or the owner of the directory that holds the link owns it. A link that another
user planted (``/tmp/run -> /home/you``, made by someone else) is refused with
:class:`WriteError` before anything is written (:func:`check_directory`).

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as d:
...     victim = Path(d, "victim.txt")
...     _ = victim.write_text("keep me")
...     Path(d, "out.txt").symlink_to(victim)  # a planted link
...     _ = write_text(Path(d, "out.txt"), "report")
...     victim.read_text(), Path(d, "out.txt").is_symlink(), sorted(os.listdir(d))
('keep me', False, ['out.txt', 'victim.txt'])
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from attnkit.errors import AttentionInputError

__all__ = [
    "WriteError",
    "check_directory",
    "errno_of",
    "make_directory",
    "os_error",
    "read_own_text",
    "replacing",
    "write_bytes",
    "write_text",
]

_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
_UMASK_LOCK = threading.Lock()


class WriteError(AttentionInputError):
    """A file could not be written; the file it would have replaced is intact.

    Besides the parts of :class:`~attnkit.AttentionInputError`: ``path`` (the file) and
    ``errno`` (the system's error number, ``errno.ENOSPC`` for a full disk; ``None`` when no
    system call failed, as for a refused link).
    """

    def __init__(self, *args: Any, path: Path, errno: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.path = path
        self.errno = errno

    def at(self, where: str, argument: str, *, fix: str | None = None) -> WriteError:
        """The same error, said by ``where`` about its ``argument`` (and with ``fix``)."""
        return WriteError(
            where,
            argument,
            self.problem,
            got=self.got,
            expected=self.expected,
            fix=fix or self.fix,
            path=self.path,
            errno=self.errno,
        )

    def __reduce__(self) -> tuple[Any, ...]:  # crosses process boundaries (``--ddp`` ranks)
        parts = (self.where, self.argument, self.problem, self.got, self.expected, self.fix)
        return (_rebuild, (*parts, self.path, self.errno))


def _rebuild(
    where: str,
    argument: str,
    problem: str,
    got: str,
    expected: str,
    fix: str | None,
    path: Path,
    number: int | None,
) -> WriteError:
    return WriteError(
        where, argument, problem, got=got, expected=expected, fix=fix, path=path, errno=number
    )


def os_error(
    e: OSError,
    path: str | os.PathLike[str],
    *,
    where: str = "attnkit",
    argument: str = "path",
    what: str | None = None,
    existed: bool = True,
    fix: str | None = None,
) -> WriteError:
    """The :class:`WriteError` for ``e``, raised while writing ``path`` (``what``: how the
    message names the previous file, its name by default; ``existed``: whether there was one).

    >>> print(os_error(OSError(errno.ENOSPC, "No space left on device"), "run/c.st",
    ...                what="checkpoint").problem)
    no space left on device while writing run/c.st; the previous checkpoint is intact.
    """
    path = Path(path)
    kept = f"the previous {what or path.name} is intact" if existed else "no file was left there"
    full = _FULL.get(e.errno or 0)
    if full is not None:
        problem = f"{full} while writing {path}; {kept}."
        default_fix = "free some space on that disk, or write somewhere else"
    else:
        problem = f"cannot write {path}: {e.strerror or e}; {kept}."
        default_fix = "choose another output directory"
    name = errno.errorcode.get(e.errno or 0, "an OSError")
    return WriteError(
        where,
        argument,
        problem,
        got=f"{argument} = {str(path)!r} ({name})",
        expected="a file in a writable directory with room for it",
        fix=fix or default_fix,
        path=path,
        errno=e.errno,
    )


def check_directory(
    directory: str | os.PathLike[str], *, where: str = "attnkit", argument: str = "path"
) -> None:
    """Refuse a directory reached through a symbolic link that another user planted.

    Every existing component of ``directory`` (made absolute, not resolved) that is a link must
    be owned by this user, by root, or by the owner of the directory holding the link (the rule
    of Linux's ``fs.protected_symlinks``). Components that do not exist yet are not checked.
    """
    here = Path(os.path.abspath(directory))
    me = os.geteuid() if hasattr(os, "geteuid") else None
    for part in (here, *here.parents):
        try:
            st = os.lstat(part)
        except OSError:
            continue
        if me is None or not stat.S_ISLNK(st.st_mode) or st.st_uid in (me, 0):
            continue
        try:
            holder = os.lstat(part.parent).st_uid
        except OSError:
            holder = None
        if st.st_uid == holder:
            continue
        raise WriteError(
            where,
            argument,
            f"{part} is a symbolic link owned by another user (uid {st.st_uid}); attnkit does "
            f"not write through it, so nothing was written under {directory}.",
            got=f"{argument} = {str(directory)!r}",
            expected="a directory reached through no link owned by someone else",
            fix=f"write into a directory you own, or remove the link {part}",
            path=Path(directory),
        )


def make_directory(
    directory: str | os.PathLike[str], *, where: str = "attnkit", argument: str = "path"
) -> Path:
    """:func:`check_directory`, then create ``directory`` and its parents where missing
    (an :class:`OSError` from that is the caller's)."""
    check_directory(directory, where=where, argument=argument)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _umask() -> int:
    try:  # Linux: read it, without the set-and-restore race of os.umask
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _mode(previous: os.stat_result | None) -> int:
    """The permissions of the new file: the previous one's when it is this user's regular file,
    else what ``open(path, "w")`` gives a new file."""
    mine = previous is not None and hasattr(os, "geteuid") and previous.st_uid == os.geteuid()
    if previous is not None and stat.S_ISREG(previous.st_mode) and mine:
        return stat.S_IMODE(previous.st_mode) & 0o777
    return 0o666 & ~_umask()


def _settle(path: Path, mode: int) -> None:
    """Give the written file its permissions (again: a writer may have made its own file, as
    safetensors does, with ``0o600``) and flush it to disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable; best effort (some file systems cannot)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        with suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def replacing(
    path: str | os.PathLike[str],
    *,
    where: str = "attnkit",
    argument: str = "path",
    what: str | None = None,
    fix: str | None = None,
) -> Iterator[Path]:
    """Yield a new temporary file next to ``path`` for the caller to write (by its name: for
    ``savefig``, ``save_file``, ``np.savez``); when the block ends, move it over ``path``.

    An :class:`OSError` in the block, or while creating, syncing or moving the file, becomes a
    :class:`WriteError` (see :func:`os_error`; ``what`` and ``fix`` are passed on); on any
    exception the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    parent = path.parent
    check_directory(parent, where=where, argument=argument)
    previous: os.stat_result | None = None
    tmp: Path | None = None
    try:
        previous = _lstat(path)
        regular = previous is not None and stat.S_ISREG(previous.st_mode)
        if regular and not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, "the file is read-only", str(path))
        mode = _mode(previous)
        fd, name = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
        tmp = Path(name)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        yield tmp
        _settle(tmp, mode)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        kept = previous is not None and not stat.S_ISLNK(previous.st_mode)
        raise os_error(
            e, path, where=where, argument=argument, what=what, existed=kept, fix=fix
        ) from e
    finally:
        if tmp is not None:
            with suppress(OSError):
                tmp.unlink(missing_ok=True)
    _fsync_directory(parent)


def write_bytes(path: str | os.PathLike[str], data: bytes, **kwargs: Any) -> Path:
    """Write ``data`` to ``path`` as :func:`replacing` does (the same keywords)."""
    with replacing(path, **kwargs) as tmp:
        fd = os.open(tmp, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    return Path(path)


def write_text(
    path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8", **kwargs: Any
) -> Path:
    """Write ``text`` to ``path`` as :func:`replacing` does (the same keywords)."""
    return write_bytes(path, text.encode(encoding, errors="surrogateescape"), **kwargs)


def read_own_text(path: str | os.PathLike[str], *, encoding: str = "utf-8") -> str:
    """The text of ``path`` when it is a regular file, else ``""``: a symbolic link (never
    followed), a missing file, a FIFO or a device read as empty. For writers that edit a file
    in place (between markers): what they write then replaces whatever was there.

    Bytes that are not ``encoding`` survive a round trip through :func:`write_text`.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO, errno.ENOTDIR):
            return ""
        raise
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return ""
        return f.read().decode(encoding, errors="surrogateescape")


_OS_ERROR = re.compile(r"os error (\d+)")


def errno_of(message: str) -> int | None:
    """The ``errno`` in a Rust I/O error's message (safetensors: ``... (os error 28)``)."""
    found = _OS_ERROR.search(message)
    return int(found.group(1)) if found else None
