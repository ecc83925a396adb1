"""Each mask rule has one home: its class in :mod:`attnkit.masks` says everything about it, and
no import circle runs through the masks or the ``blocked`` backend."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

import attnkit
import attnkit.interop.hf_attention  # its unmasked rule: a spec from attnkit.masks
from attnkit import masks
from attnkit.masks import MaskSpec

ROOT = Path(attnkit.__file__).resolve().parent


def _circle_finder():  # type: ignore[no-untyped-def]
    """tests/core/test_import_circles.py's graph and circle finder (one implementation)."""
    path = Path(__file__).resolve().parents[1] / "core" / "test_import_circles.py"
    spec = importlib.util.spec_from_file_location("_import_circles", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("_import_circles", module)
    spec.loader.exec_module(module)
    return module._graph, module._circles


def test_no_circle_runs_through_the_masks_or_the_blocked_backend() -> None:
    graph, circles = _circle_finder()
    modules = graph()
    assert "attnkit.masks.spec" in modules["attnkit.masks.rules"]  # it reads the package
    guarded = ("attnkit.masks", "attnkit.backends.blocked")
    bad = [sorted(c) for c in circles(modules) if any(m.startswith(guarded) for m in c)]
    assert bad == []


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def test_only_attnkit_masks_defines_mask_rules() -> None:
    outside = [
        f"{c.__module__}.{c.__qualname__}"
        for c in _subclasses(MaskSpec)
        if c.__module__.startswith("attnkit.") and not c.__module__.startswith("attnkit.masks")
    ]
    assert outside == []
    assert repr(attnkit.interop.hf_attention.UNMASKED) == repr(masks.unmasked())


def test_the_mask_modules_stay_under_500_lines() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "masks").glob("*.py")}
    assert sizes
    assert max(sizes.values()) <= 500, sizes


def test_a_rule_says_its_runs_and_a_rule_that_does_not_says_none() -> None:
    pos = torch.arange(4)[None]
    lo, hi = (masks.causal() & masks.sliding_window(2)).key_runs(pos, 1)
    assert lo.tolist() == [[0, 1, 2, 3]]
    assert hi.tolist() == [[1, 2, 3, 4]]
    assert (~masks.causal()).key_runs(pos, 0) is None
    assert masks.unmasked().key_runs(pos, 0) is None  # as before: not given to the kernel


def test_a_spec_is_made_again_from_its_fields() -> None:
    spec = masks.padding(torch.tensor([3, 1])) & masks.causal()
    fields = spec.compile_fields()
    assert set(fields) >= {"a", "b"}
    again = type(spec).from_fields(fields)
    assert repr(again) == repr(spec)
    assert torch.equal(again.to_dense(3, 4), spec.to_dense(3, 4))
