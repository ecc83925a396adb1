"""MaskSpec.digest(): a mask's content (its rule and the bytes of every tensor it holds), equal
in any process for equal masks; what ring attention compares across ranks (issue 22, item 10;
the multi-process checks are in tests/distributed/test_ring.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from attnkit import masks
from attnkit.masks import MaskSpec
from attnkit.masks.sequence import sequence_causal


def _ids(n: int = 12, cut: int = 5) -> torch.Tensor:
    ids = torch.zeros(n, dtype=torch.long)
    ids[cut:] = 1
    return ids


def _keep(hole: int = 3) -> torch.Tensor:
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, hole] = False
    return keep


def _dense(dtype: torch.dtype, corner: float = 0.0) -> MaskSpec:
    m = torch.zeros(12, 12, dtype=dtype)
    m[0, -1] = corner
    return masks.as_spec(m if dtype != torch.bool else m.bool())


#: per rule holding tensors: the same mask built twice apart, and one differing in one value
#: (same shapes, so the same repr where it shows only shapes)
PAIRS: dict[str, tuple[Callable[[], MaskSpec], Callable[[], MaskSpec]]] = {
    "document": (lambda: masks.document(_ids()), lambda: masks.document(_ids(cut=6))),
    "document_batched": (
        lambda: masks.document(_ids()[None].repeat(2, 1)),
        lambda: masks.document(torch.stack([_ids(), _ids(cut=4)])),
    ),
    "key_mask": (lambda: masks.key_mask(_keep()), lambda: masks.key_mask(_keep(hole=4))),
    "padding": (
        lambda: masks.padding(torch.arange(70) % 12),
        lambda: masks.padding((torch.arange(70) % 12).index_fill(0, torch.tensor([69]), 3)),
    ),
    "padding_q_lengths": (
        lambda: masks.padding(torch.tensor([12, 9]), q_lengths=torch.tensor([12, 7])),
        lambda: masks.padding(torch.tensor([12, 9]), q_lengths=torch.tensor([12, 8])),
    ),
    "prefix_lm": (
        lambda: masks.prefix_lm(torch.tensor([3, 4])),
        lambda: masks.prefix_lm(torch.tensor([3, 5])),
    ),
    "sequence_causal": (
        lambda: sequence_causal(torch.tensor([9, 12]), 2),
        lambda: sequence_causal(torch.tensor([10, 12]), 2),
    ),
    "dense_bool": (lambda: _dense(torch.bool), lambda: _dense(torch.bool, 1.0)),
    "dense_float": (lambda: _dense(torch.float32), lambda: _dense(torch.float32, -1.0)),
    "dense_bfloat16": (lambda: _dense(torch.bfloat16), lambda: _dense(torch.bfloat16, -1.0)),
    "dense_float16": (lambda: _dense(torch.float16), lambda: _dense(torch.float16, 0.5)),
    "combined": (
        lambda: masks.causal() & masks.document(_ids()) | masks.key_mask(_keep()),
        lambda: masks.causal() & masks.document(_ids()) | masks.key_mask(_keep(hole=5)),
    ),
    "inverted": (lambda: ~masks.key_mask(_keep()), lambda: ~masks.key_mask(_keep(hole=5))),
    "head_slice": (
        lambda: (masks.alibi(4) & masks.document(_ids())).select_heads(0, 2),
        lambda: (masks.alibi(4) & masks.document(_ids(cut=2))).select_heads(0, 2),
    ),
}


#: the specs whose repr lists their tensors' values (up to 64 of them)
REPR_SHOWS_VALUES = {"padding_q_lengths", "prefix_lm", "sequence_causal"}


@pytest.mark.parametrize("name", list(PAIRS))
def test_equal_contents_agree_and_one_changed_value_differs(name: str) -> None:
    same, other = PAIRS[name]
    a, b, c = same(), same(), other()
    assert a is not b
    assert a.digest() == b.digest()
    assert a.digest() != c.digest()
    assert len(a.digest()) == 32  # 128 bits, in hex
    if name not in REPR_SHOWS_VALUES:  # the repr shows shapes only: it could not tell
        assert repr(a) == repr(c)


def test_the_rule_its_parameters_and_the_tensors_dtype_and_shape_count() -> None:
    digests = [
        s.digest()
        for s in (
            masks.causal(),
            masks.sliding_window(4),
            masks.sliding_window(5),
            masks.causal() & masks.sliding_window(4),
            masks.sliding_window(4) & masks.causal(),
            masks.alibi(4),
            masks.alibi(8),
            masks.prefix_lm(3),
            masks.document(_ids()),
            masks.document(_ids().int()),  # the same ids as int32
            masks.document(_ids()[None]),  # as (1, S)
        )
    ]
    assert len(set(digests)) == len(digests)
    assert masks.causal().digest() == masks.causal().digest()


def test_views_caches_and_where_the_spec_was_used_do_not_count() -> None:
    """A non-contiguous view and its copy agree; a dense mask's prefix sums (built on first
    use) are a cache, not content."""
    base = torch.zeros(12, 24, dtype=torch.long)
    base[:, 1::2] = _ids()
    view = masks.document(base[:, 1::2][0])  # strided
    assert view.digest() == masks.document(_ids()).digest()
    dense = _dense(torch.bool, 1.0)
    before = dense.digest()
    dense.block_map(12, 12, 4, 4)  # builds the prefix sums
    assert dense.digest() == before


def test_a_users_spec_counts_by_its_values_and_its_functions_code() -> None:
    class Near(MaskSpec):
        def __init__(self, size: int, ids: torch.Tensor) -> None:
            self.rule = lambda d: d < size
            self.ids = ids
            self.parts = {"w": size, "extra": [ids, None]}

        def __repr__(self) -> str:
            return "near()"

    a, b = Near(3, _ids()), Near(3, _ids())
    assert a.digest() == b.digest()
    assert Near(4, _ids()).digest() != a.digest()  # the value the rule closes over
    assert Near(3, _ids(cut=6)).digest() != a.digest()
    b.rule = lambda d: d <= 3
    assert b.digest() != a.digest()  # other code
    # a tensor with no values to read (meta) counts by its dtype and shape
    meta = masks.document(torch.zeros(12, dtype=torch.long, device="meta"))
    assert (
        meta.digest() != masks.document(torch.zeros(13, dtype=torch.long, device="meta")).digest()
    )


SCRIPT = """
import torch
from attnkit import masks


def digests():
    ids = torch.zeros(12, dtype=torch.long)
    ids[5:] = 1
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, 3] = False
    specs = {
        "document": masks.document(ids),
        "combined": masks.causal() & masks.document(ids) | masks.key_mask(keep),
        "alibi": masks.alibi(4) & masks.sliding_window(3),
        "dense": masks.as_spec(torch.zeros(12, 12, dtype=torch.bfloat16)),
    }
    return {k: s.digest() for k, s in specs.items()}
"""


def test_digests_are_the_same_in_another_process() -> None:
    """Nothing of the process goes in (no id, no address, no hash seed)."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT + "\nimport json\nprint(json.dumps(digests()))"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": src, "PYTHONHASHSEED": "123"},
    )
    assert proc.returncode == 0, proc.stderr
    ns: dict[str, Any] = {}
    exec(SCRIPT, ns)
    assert json.loads(proc.stdout) == ns["digests"]()


@pytest.mark.cuda
def test_a_spec_on_the_gpu_has_the_digest_of_the_same_spec_on_the_cpu() -> None:
    ids = _ids()
    keep = _keep()
    for make in (
        lambda d: masks.document(ids.to(d)) & masks.key_mask(keep.to(d)),
        lambda d: masks.alibi(4, device=d),
        lambda d: masks.as_spec(torch.zeros(12, 12, dtype=torch.bfloat16, device=d)),
    ):
        assert make("cuda").digest() == make("cpu").digest()
