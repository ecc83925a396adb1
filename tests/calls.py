"""``make_call``: an :class:`~attnkit.call.AttentionCall` built from attention's arguments, as
:func:`attnkit.attention` builds it (every check, then :meth:`AttentionCall.build`), for tests
that hand a call to a backend's rules or to ``choose`` directly.

Positional like the tests that use it were written; ``key_shards`` checks a mask spec over that
many shards of the keys, as ring attention does.
"""

from __future__ import annotations

import torch

from attnkit.call import AttentionCall
from attnkit.mask_checks import check_mask
from attnkit.masks import MaskSpec
from attnkit.validate import WHERE, check_qkv, check_scalars, warn_if_inverted_causal


def make_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | MaskSpec | None,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    return_weights: bool = False,
    *,
    where: str = WHERE,
    key_shards: int = 1,
) -> AttentionCall:
    dims = check_qkv(q, k, v, where=where)
    check_mask(mask, q, dims, where=where, key_shards=key_shards)
    warn_if_inverted_causal(mask)
    check_scalars(
        dims, where=where, causal=causal, scale=scale, dropout_p=dropout_p,
        return_weights=return_weights,
    )  # fmt: skip
    return AttentionCall.build(
        q=q, k=k, v=v, dims=dims, where=where, mask=mask, causal=causal, scale=scale,
        dropout_p=dropout_p, return_weights=return_weights,
    )  # fmt: skip
