"""The map writers against hostile output paths: a link planted at ``attention.html`` (``.npz``,
``.png``) is replaced and its target left alone, for each writer and for ``attnkit show``; a full
disk leaves the previous file and no temporary one, in one error (one line and exit 2 on the
command line)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner, Result

from attnkit import AttentionInputError
from attnkit.cli import app
from attnkit.inspect import write_all, write_html, write_npz, write_png

pytest.importorskip("matplotlib", reason="the inspect extra: pip install '.[inspect]'")

ATT = np.full((2, 3, 4, 4), 0.25, dtype=np.float32)  # (N, H, T, T)
TOKENS = ["[CLS]", "hi", "there", "[SEP]"]
HIDDEN = np.zeros((4, 8), dtype=np.float32)  # (T, E)
NAMES = {"html": "attention.html", "png": "attention.png", "npz": "attention.npz"}

SINGLE: dict[str, Callable[[Path], Path]] = {
    "html": lambda p: write_html(p, ATT, TOKENS),
    "png": lambda p: write_png(p, ATT, TOKENS),
    "npz": lambda p: write_npz(p, ATT, TOKENS, HIDDEN),
}


def _plant(out: Path, names: list[str]) -> dict[str, Path]:
    """A link at each name in ``out`` to a victim file outside it."""
    out.mkdir(parents=True, exist_ok=True)
    victims = {}
    for name in names:
        victim = out.parent / f"victim-{name}"
        victim.write_text(f"the user's {name}")
        (out / name).symlink_to(victim)
        victims[name] = victim
    return victims


def _check_written(out: Path, victims: dict[str, Path]) -> None:
    for name, victim in victims.items():
        assert victim.read_text() == f"the user's {name}"
        assert not (out / name).is_symlink()
    if "attention.npz" in victims:
        with np.load(out / "attention.npz", allow_pickle=False) as f:
            assert f["tokens"].tolist() == TOKENS
    if "attention.png" in victims:
        assert (out / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if "attention.html" in victims:
        assert (out / "attention.html").read_text(encoding="utf-8").startswith("<!")
    assert sorted(p.name for p in out.iterdir()) == sorted(victims)  # no temporary file


@pytest.mark.parametrize("kind", sorted(SINGLE))
def test_each_writer_replaces_a_planted_link_never_its_target(kind: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    victims = _plant(out, [NAMES[kind]])
    SINGLE[kind](out / NAMES[kind])
    _check_written(out, victims)


def test_write_all_replaces_planted_links_never_their_targets(tmp_path: Path) -> None:
    out = tmp_path / "out"
    victims = _plant(out, list(NAMES.values()))
    write_all(out, ATT, TOKENS, HIDDEN)
    _check_written(out, victims)


def test_a_dangling_link_creates_nothing_where_it_points(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for name in NAMES.values():
        (out / name).symlink_to(tmp_path / f"made-through-{name}")
    write_all(out, ATT, TOKENS, HIDDEN)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _full(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _fill_disk(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the write of ``kind`` fail as a full disk does, inside the writer."""
    if kind == "npz":
        monkeypatch.setattr(np, "savez_compressed", _full)
    elif kind == "png":
        from matplotlib.figure import Figure

        monkeypatch.setattr(Figure, "savefig", _full)
    else:
        real = os.write  # the page is one write of more than 500 bytes

        def write(fd: int, data: bytes) -> int:
            return _full() if len(data) > 500 else real(fd, data)  # type: ignore[func-returns-value]

        monkeypatch.setattr(os, "write", write)


@pytest.mark.parametrize("kind", sorted(SINGLE))
def test_a_full_disk_keeps_the_previous_map_in_one_error(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / NAMES[kind]
    path.write_bytes(b"the previous maps")
    _fill_disk(kind, monkeypatch)
    with pytest.raises(AttentionInputError) as e:
        SINGLE[kind](path)
    monkeypatch.undo()
    assert e.value.problem == (
        f"no space left on device while writing {path}; the previous {path.name} is intact."
    )
    assert e.value.argument == "path"
    assert e.value.where == f"attnkit.inspect.write_{kind}"
    assert path.read_bytes() == b"the previous maps"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    _fill_disk(kind, monkeypatch)
    with pytest.raises(AttentionInputError) as e:
        write_all(tmp_path, ATT, TOKENS, HIDDEN)
    assert e.value.argument == "out"
    assert f"no space left on device while writing {path}; " in e.value.problem


# ---------------------------------------------------------------------------------------------
# attnkit show


runner = CliRunner()


def _one_line_error(result: Result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("attnkit: error: ")]
    assert len(errors) == 1, result.stderr
    assert lines[-1] == errors[0]
    assert all(line.startswith("attnkit: [") for line in lines[:-1]), result.stderr
    return errors[0]


def test_show_replaces_planted_links_and_a_full_disk_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    victims = _plant(out, list(NAMES.values()))
    result = runner.invoke(app, ["show", "a short text", "--out", str(out)])
    assert result.exit_code == 0, result.output
    for name, victim in victims.items():
        assert victim.read_text() == f"the user's {name}"
        assert not (out / name).is_symlink()
    assert sorted(p.name for p in out.iterdir()) == sorted(NAMES.values())
    before = {name: (out / name).read_bytes() for name in NAMES.values()}
    monkeypatch.setattr(np, "savez_compressed", _full)
    line = _one_line_error(runner.invoke(app, ["show", "a short text", "--out", str(out)]))
    npz = out / "attention.npz"
    assert line.startswith(
        f"attnkit: error: no space left on device while writing {npz}; the previous "
        "attention.npz is intact. (fix: "
    )
    assert {name: (out / name).read_bytes() for name in NAMES.values()} == before


def _other_users_link(tmp_path: Path) -> tuple[Path, Path]:
    home = tmp_path / "home"
    home.mkdir()
    link = tmp_path / "shared-run"
    link.symlink_to(home)
    os.lchown(link, 12345, 12345)
    return link, home


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's link needs root")
def test_an_out_directory_linked_by_another_user_is_refused(tmp_path: Path) -> None:
    link, home = _other_users_link(tmp_path)
    with pytest.raises(AttentionInputError, match="symbolic link owned by another user") as e:
        write_all(link, ATT, TOKENS, HIDDEN)
    assert e.value.argument == "out"
    with pytest.raises(AttentionInputError, match="owned by another user") as e:
        write_npz(link / "deeper" / "a.npz", ATT, TOKENS, HIDDEN)
    assert e.value.argument == "path"
    assert list(home.iterdir()) == []
