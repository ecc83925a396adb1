"""Every ```python block of the README runs, in order, in one namespace."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_blocks_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 8
    namespace: dict[str, object] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, block in enumerate(blocks):
            exec(compile(block, f"README.md block {i}", "exec"), namespace)


def test_readme_opens_with_the_two_commands() -> None:
    head = "\n".join(README.read_text().splitlines()[:15])
    assert "make demo" in head
    assert "make test" in head
