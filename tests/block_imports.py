"""A pytest plugin that hides packages, as on a machine where they are not installed.

``ATTNKIT_BLOCK_IMPORTS=playwright,transformers python -m pytest -p block_imports ...`` (with
``tests/`` on ``PYTHONPATH``) makes every import of those packages raise
``ModuleNotFoundError``; tests/core/test_optional_packages.py collects the suite this way and checks
that the tests needing them are skipped and collection never fails.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

HIDDEN = frozenset(n for n in os.environ.get("ATTNKIT_BLOCK_IMPORTS", "").split(",") if n)


class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {fullname!r} (hidden)", name=fullname)
        return None


if HIDDEN:
    sys.meta_path.insert(0, _Hide())
    for name in [n for n in sys.modules if n.split(".")[0] in HIDDEN]:
        del sys.modules[name]
