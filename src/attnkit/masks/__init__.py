"""Masks in attnkit's convention, True = may attend: dense helpers and mask *specs*.

Dimension legend: B batch, H heads, L query length, S key length; ``b, h, q, kv`` are indices.

A mask spec is a predicate on ``(b, h, q_idx, kv_idx)`` that a backend evaluates block by block,
so it never has to become an ``L x S`` tensor:

>>> spec = causal() & sliding_window(3)
>>> print(spec)
causal() & sliding_window(3), drawn for L = S = 8 (1 = may attend):
1 . . . . . . .
1 1 . . . . . .
1 1 1 . . . . .
. 1 1 1 . . . .
. . 1 1 1 . . .
. . . 1 1 1 . .
. . . . 1 1 1 .
. . . . . 1 1 1

Every spec aligns queries to the *end* of the keys, as ``causal`` does: query ``i`` of ``L``
stands at position ``i + S - L`` among ``S`` keys (what KV-cache decoding needs); predicates get
the raw indices and that offset ``off = S - L``. Specs combine
with ``&``, ``|`` and ``~``. Each has ``to_dense(L, S)`` and ``block_map(L, S, block_q,
block_k)``, which says for every (query block, key block) pair whether it is empty, partial or
full, computed from the block bounds without building ``L x S``.

Under ``torch.compile(fullgraph=True)`` a spec may be built inside the compiled function or
outside it (closed over, or passed in: new tensor values, or a new spec of the same structure,
reuse the graph), except ``~``, which Dynamo cannot trace on a Python object: build an inverted
spec outside the compiled function. Nothing on a spec's way through attnkit reads its values
while Dynamo traces (``allows_all`` answers ``False`` then).

Block maps are exact for the built-in specs; combinations keep two guarantees that make
skipping safe: a block called *empty* has no allowed pair, and a block called *full* has no
blocked pair (a combination may call a block *partial* that is in fact empty or full; a backend
then evaluates the predicate inside it).

``spec.digest()`` hashes a spec's content, its rule and the bytes of every tensor it holds, the
same in any process for the same mask (``digest.py``): ring attention compares it across ranks.

Where things live: the protocol every rule answers and :func:`block_states` in ``base.py``;
:class:`MaskSpec`, its combinators and its drawing in ``spec.py``; cache keys in ``keys.py``;
runs of keys per row in ``runs.py``; the built-in rules in ``rules.py``; ALiBi in ``alibi.py``;
a mask function as a spec (:func:`from_function`) in ``function.py``; two masks side by side
over the keys (:func:`concat_keys`: a decoder's own keys and an encoder's) in ``concat.py``;
the KV cache's per-sequence causal rule in ``sequence.py``; each query's own
keys (DeepSeek-V3.2's top-k, :func:`selected_keys`) in ``selected.py``; a mask tensor as a spec in
``dense.py``; :func:`row_spans` (a spec as one run of keys per query row, where it is one: what
attnkit's row-span kernel runs) in ``spans.py``; a spec's fields for ``torch.compile`` in
``fields.py``; and :func:`as_spec`, the one place
where the ``causal`` flag and a mask combine, in ``normalize.py``. Constructors raise
:class:`~attnkit.AttentionInputError` with the fix. A spec built from per-key tensors
(``key_mask``, ``document``) has a ``length``, which must be the call's ``S``; ``to_dense``
refuses, before allocating, a dense form above attnkit's memory limit (:mod:`attnkit.memory`;
``dense_bytes`` says what it would take).
"""

from attnkit.masks.alibi import alibi, alibi_slopes, split_alibi
from attnkit.masks.base import EMPTY, FULL, PARTIAL, BlockMap, block_states
from attnkit.masks.concat import concat_keys
from attnkit.masks.dense import DenseMask
from attnkit.masks.function import from_function
from attnkit.masks.keys import tensor_key
from attnkit.masks.normalize import as_spec
from attnkit.masks.rules import (
    causal,
    causal_mask,
    causal_window,
    document,
    is_causal,
    key_mask,
    padding,
    prefix_lm,
    sliding_window,
    unmasked,
)
from attnkit.masks.selected import selected_keys
from attnkit.masks.sequence import sequence_causal
from attnkit.masks.spans import key_holes, local_keys, row_spans
from attnkit.masks.spec import MaskSpec

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BlockMap",
    "DenseMask",
    "MaskSpec",
    "alibi",
    "alibi_slopes",
    "as_spec",
    "block_states",
    "causal",
    "causal_mask",
    "causal_window",
    "concat_keys",
    "document",
    "from_function",
    "is_causal",
    "key_holes",
    "key_mask",
    "local_keys",
    "padding",
    "prefix_lm",
    "row_spans",
    "selected_keys",
    "sequence_causal",
    "sliding_window",
    "split_alibi",
    "tensor_key",
    "unmasked",
]
