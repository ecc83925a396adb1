"""Source sizes (issue 23 item 8): no Python file in ``src/attnkit`` over 500 lines, no function
over 80 lines without the reason in its docstring.

A function's length is ``end_lineno - lineno + 1``: from its ``def`` line to its last line,
**docstring included** (decorators not). Methods and nested functions count on their own (a
nested function's lines also count in the function around it). A function over the limit
passes when its docstring says why, with the fixed marker ``long because`` followed by the
reason (any case, line breaks allowed), e.g. "Long because the docstring's examples are the
reference for every argument."
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "attnkit"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
MARKER = re.compile(r"\blong because\s+\S", re.IGNORECASE)

#: Known offenders waiting for a fix: ``path`` (a file over the limit) or
#: ``path::qualified.name`` (a function), with the area that owns the fix; none today. An entry
#: that is no longer an offender fails :func:`test_pending_entries_still_offend`.
PENDING: dict[str, str] = {}


def _functions(
    node: ast.AST, prefix: str = ""
) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function under ``node`` with its qualified name (``Class.method``, ``f.inner``)."""
    found: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((prefix + child.name, child))
            found += _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            found += _functions(child, f"{prefix}{child.name}.")
        else:
            found += _functions(child, prefix)
    return found


def offenders(root: Path) -> dict[str, str]:
    """``{key: what is wrong}`` for the files and functions under ``root`` over the limits."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            found[rel] = f"{lines} lines (at most {MAX_FILE_LINES})"
        for name, fn in _functions(ast.parse(text, filename=str(path))):
            length = (fn.end_lineno or fn.lineno) - fn.lineno + 1
            doc = " ".join((ast.get_docstring(fn) or "").split())
            if length > MAX_FUNCTION_LINES and not MARKER.search(doc):
                found[f"{rel}::{name}"] = (
                    f"line {fn.lineno}: {length} lines (at most {MAX_FUNCTION_LINES} without "
                    "'long because <reason>' in its docstring)"
                )
    return found


def _listing(entries: dict[str, str]) -> str:
    return "\n".join(f"  {key}: {why}" for key, why in sorted(entries.items()))


def test_no_file_or_function_over_the_limits() -> None:
    bad = {k: v for k, v in offenders(SRC).items() if k not in PENDING}
    assert not bad, (
        f"over the size limits in {SRC} (split into well-named helpers, or say in the "
        f"function's docstring 'long because <reason>'):\n{_listing(bad)}"
    )


def test_pending_entries_still_offend() -> None:
    found = offenders(SRC)
    stale = {k: f"fixed (owner: {owner}): remove it from PENDING" for k, owner in PENDING.items()}
    stale = {k: v for k, v in stale.items() if k not in found}
    assert not stale, f"PENDING entries that are no longer offenders:\n{_listing(stale)}"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _function(name: str, lines: int, doc: str = "", indent: str = "") -> str:
    """Source of a function of exactly ``lines`` lines (``def`` and docstring included)."""
    head = [f"{indent}def {name}() -> int:", f'{indent}    """{doc}"""']
    body = [f"{indent}    x = {i}" for i in range(lines - 3)]
    return "\n".join([*head, *body, f"{indent}    return 0"]) + "\n"


@pytest.mark.parametrize("lines", [MAX_FUNCTION_LINES, MAX_FUNCTION_LINES + 1])
def test_checker_counts_function_lines_with_the_docstring(tmp_path: Path, lines: int) -> None:
    _write(tmp_path / "pkg" / "a.py", _function("f", lines))
    found = offenders(tmp_path)
    if lines > MAX_FUNCTION_LINES:
        assert list(found) == ["pkg/a.py::f"]
        assert f"{lines} lines" in found["pkg/a.py::f"]
    else:
        assert found == {}


def test_checker_names_methods_and_nested_functions(tmp_path: Path) -> None:
    long = MAX_FUNCTION_LINES + 5
    method = _function("m", long, indent="    ")
    _write(tmp_path / "b.py", "class C:\n" + method + "\n\n" + _function("g", 10))
    outer = "def outer() -> None:\n" + _function("inner", long, indent="    ")
    _write(tmp_path / "c.py", outer)
    assert set(offenders(tmp_path)) == {"b.py::C.m", "c.py::outer", "c.py::outer.inner"}


def test_checker_accepts_a_reason_and_only_a_reason(tmp_path: Path) -> None:
    long = MAX_FUNCTION_LINES + 1
    _write(tmp_path / "ok.py", _function("f", long, doc="Long\n    because the loop is a kernel."))
    _write(tmp_path / "bare.py", _function("f", long, doc="It is long because"))
    _write(tmp_path / "none.py", _function("f", long, doc="Does things."))
    assert set(offenders(tmp_path)) == {"bare.py::f", "none.py::f"}


def test_checker_counts_file_lines(tmp_path: Path) -> None:
    _write(tmp_path / "fits.py", "x = 1\n" * MAX_FILE_LINES)
    _write(tmp_path / "big.py", "x = 1\n" * (MAX_FILE_LINES + 1))
    found = offenders(tmp_path)
    assert list(found) == ["big.py"]
    assert f"{MAX_FILE_LINES + 1} lines" in found["big.py"]
