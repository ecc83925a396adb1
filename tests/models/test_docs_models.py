"""Every ```python block of docs/models.md runs, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_models_doc_python_blocks_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 6
    namespace: dict[str, object] = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/models.md block {i}", "exec"), namespace)
    assert namespace["layer"].__class__.__name__ == "TransformerLayer"
