"""``import attnkit`` alone: the core loads without the extras, and every subpackage the README
names is reached as an attribute (``attnkit.interop.mask_from_torch``), imported on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest

import attnkit


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_the_core_imports_without_transformers_and_reaches_interop_on_first_use() -> None:
    code = (
        "import sys, attnkit\n"
        "print('transformers' in sys.modules)\n"
        "print(attnkit.interop.mask_from_torch.__module__)\n"
    )
    assert _run(code).splitlines() == ["False", "attnkit.modules.torch_masks"]


@pytest.mark.parametrize("name", attnkit._SUBPACKAGES)
def test_each_subpackage_is_an_attribute(name: str) -> None:
    assert getattr(attnkit, name).__name__ == f"attnkit.{name}"


def test_a_name_that_is_not_there_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'attnkit' has no attribute 'interopp'"):
        _ = attnkit.interopp  # type: ignore[attr-defined]
