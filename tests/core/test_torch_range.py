"""The torch range pyproject declares includes the torch the Makefile installs and this one."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]


def _torch_requirement() -> Requirement:
    """The one torch line of ``[project] dependencies`` (tomllib is not in Python 3.10)."""
    text = (REPO / "pyproject.toml").read_text()
    deps = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    (line,) = re.findall(r'"(torch[^"]*)"', deps)
    return Requirement(line)


def test_the_declared_torch_range_holds_the_pinned_and_the_running_torch() -> None:
    spec = _torch_requirement().specifier
    pinned = re.search(r"torch==([0-9.]+)", (REPO / "Makefile").read_text())
    assert pinned is not None
    assert Version(pinned.group(1)) in spec
    assert Version(torch.__version__.split("+")[0]) in spec
    assert list(spec.filter(["2.4.0", "99.0"])) == []  # bounded on both sides
