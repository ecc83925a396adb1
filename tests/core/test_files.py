"""attnkit.files, the one writer every output goes through: a planted link is replaced, never
followed; a failed write (a full disk) leaves the previous file intact, no temporary file behind,
and says so in one error; permissions are those of a plain ``open(path, "w")``.

The writers that use it (maps, checkpoints, bench reports) are tested against the same hostile
files in their own modules; here is the helper itself.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from attnkit import AttentionInputError, files
from attnkit.files import WriteError


def _plant(tmp_path: Path, name: str = "out.txt") -> tuple[Path, Path]:
    """A victim file and a link to it at ``name``, as someone else would leave them."""
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's data")
    link = tmp_path / name
    link.symlink_to(victim)
    return link, victim


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize(
    "write",
    [
        lambda p: files.write_text(p, "new"),
        lambda p: files.write_bytes(p, b"new"),
        lambda p: _by_name(p),
    ],
    ids=["write_text", "write_bytes", "replacing"],
)
def test_a_planted_link_is_replaced_and_its_target_untouched(tmp_path: Path, write: object) -> None:
    link, victim = _plant(tmp_path)
    write(link)  # type: ignore[operator]
    assert victim.read_text() == "the user's data"
    assert not link.is_symlink()
    assert link.read_bytes() == b"new"
    assert _listing(tmp_path) == ["out.txt", "victim.txt"]  # no temporary file left


def _by_name(path: Path) -> None:
    with files.replacing(path) as tmp:
        assert tmp.parent == path.parent  # same directory: os.replace is a rename
        assert tmp.name.startswith(".out.txt.")
        assert tmp.name.endswith(".tmp")
        tmp.write_bytes(b"new")


def test_a_dangling_link_creates_no_file_where_it_points(tmp_path: Path) -> None:
    link = tmp_path / "out.txt"
    link.symlink_to(tmp_path / "created-through-the-link")
    files.write_text(link, "new")
    assert link.read_text() == "new"
    assert not (tmp_path / "created-through-the-link").exists()


@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, number: int
) -> None:
    path = tmp_path / "report.json"
    path.write_text("previous")

    def full(fd: int, data: object) -> int:
        raise OSError(number, os.strerror(number))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(WriteError) as e:
        files.write_text(path, "new", where="attnkit bench", argument="--json")
    monkeypatch.undo()
    assert path.read_text() == "previous"
    assert _listing(tmp_path) == ["report.json"]
    assert isinstance(e.value, AttentionInputError)
    assert (e.value.where, e.value.argument, e.value.errno) == ("attnkit bench", "--json", number)
    assert e.value.path == path
    said = {
        errno.ENOSPC: f"no space left on device while writing {path}; ",
        errno.EDQUOT: f"disk quota exceeded while writing {path}; ",
        errno.EIO: f"cannot write {path}: {os.strerror(errno.EIO)}; ",
    }[number]
    assert e.value.problem == said + "the previous report.json is intact."
    assert "\n" not in e.value.problem


def test_a_full_disk_on_a_new_file_says_nothing_was_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "new.png"

    def fill(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(WriteError, match="no space left on device while writing") as e:
        _write_with(path, fill, what="plot", fix="free some space")
    assert e.value.problem.endswith("; no file was left there.")
    assert e.value.fix == "free some space"
    assert _listing(tmp_path) == []


def _write_with(path: Path, write: Callable[[Path], None], **kwargs: Any) -> None:
    with files.replacing(path, **kwargs) as tmp:
        write(tmp)


def test_any_exception_removes_the_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "a.bin"
    path.write_bytes(b"old")
    for error in (KeyboardInterrupt, ValueError):

        def fail(tmp: Path, error: type[BaseException] = error) -> None:
            tmp.write_bytes(b"half")
            raise error

        with pytest.raises(error):
            _write_with(path, fail)
        assert _listing(tmp_path) == ["a.bin"]
        assert path.read_bytes() == b"old"


def test_a_failed_rename_keeps_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.safetensors"
    path.write_bytes(b"old")

    def fail(src: object, dst: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(WriteError, match="the previous checkpoint is intact"):
        files.write_bytes(path, b"new", what="checkpoint")
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert _listing(tmp_path) == ["checkpoint.safetensors"]


def test_new_files_get_the_umask_and_replaced_files_keep_their_mode(tmp_path: Path) -> None:
    previous = os.umask(0o027)
    try:
        fresh = files.write_text(tmp_path / "fresh.txt", "x")
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o640  # 0o666 & ~0o027, not mkstemp's 0o600
        kept = tmp_path / "kept.txt"
        kept.write_text("x")
        kept.chmod(0o604)
        files.write_text(kept, "y")
        assert stat.S_IMODE(kept.stat().st_mode) == 0o604
    finally:
        os.umask(previous)


def test_a_read_only_file_is_refused_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "results.json"
    path.write_text("keep")
    path.chmod(0o444)
    # root may write any file; what a user without permission gets is what access() says
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False)
    with pytest.raises(WriteError, match=r"the file is read-only; the previous results\.json"):
        files.write_text(path, "new")
    assert path.read_text() == "keep"
    assert _listing(tmp_path) == ["results.json"]


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's link needs root")
def test_a_directory_link_planted_by_another_user_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "home"
    target.mkdir()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    link = shared / "run"
    link.symlink_to(target)
    os.lchown(link, 12345, 12345)  # planted by uid 12345 in a directory root owns
    with pytest.raises(WriteError, match=r"is a symbolic link owned by another user \(uid 12345\)"):
        files.write_text(link / "out.txt", "x")
    with pytest.raises(WriteError, match="owned by another user"):
        files.make_directory(link / "deeper")
    assert list(target.iterdir()) == []
    os.lchown(link, os.geteuid(), os.getegid())  # the user's own link is followed
    files.write_text(link / "out.txt", "x")
    assert (target / "out.txt").read_text() == "x"


def test_read_own_text_never_reads_through_a_link_or_a_fifo(tmp_path: Path) -> None:
    link, _ = _plant(tmp_path)
    assert files.read_own_text(link) == ""
    assert files.read_own_text(tmp_path / "missing") == ""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert files.read_own_text(fifo) == ""  # returns at once: no writer needed
    plain = tmp_path / "plain.md"
    plain.write_bytes(b"caf\xc3\xa9 \xff")  # not all UTF-8: survives a round trip
    files.write_text(plain, files.read_own_text(plain))
    assert plain.read_bytes() == b"caf\xc3\xa9 \xff"


def test_write_errors_cross_process_boundaries() -> None:
    import pickle

    e = files.os_error(OSError(errno.ENOSPC, "No space left on device"), "run/c", what="c")
    again = pickle.loads(pickle.dumps(e.at("attnkit train", "out")))
    assert isinstance(again, WriteError)
    assert (again.where, again.argument, again.errno) == ("attnkit train", "out", errno.ENOSPC)
    assert str(again) == str(e.at("attnkit train", "out"))


def test_errno_of_reads_a_rust_io_error() -> None:
    message = "Error while serializing: I/O error: No space left on device (os error 28)"
    assert files.errno_of(message) == errno.ENOSPC
    assert files.errno_of("Error while serializing: header too large") is None
