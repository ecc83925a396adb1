"""One config made from another: the fields the two share are copied, never listed twice."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["derive_config"]

C = TypeVar("C", bound="DataclassInstance")


def derive_config(cls: type[C], source: DataclassInstance, **values: Any) -> C:
    """A ``cls`` whose fields ``source`` has too (by name) are copied from ``source``.

    ``values`` set the other fields (and win over a copied one); the rest keep their defaults.
    Both are dataclasses, so the result is checked by ``cls`` as any other instance is.

    >>> from attnkit.models import GPTConfig
    >>> from attnkit.modules.transformer import TransformerConfig
    >>> layer = derive_config(TransformerConfig, GPTConfig(dim=64, num_heads=4), causal=True)
    >>> layer.dim, layer.num_heads, layer.activation, layer.causal
    (64, 4, 'gelu_tanh', True)
    """
    theirs = {f.name for f in dataclasses.fields(source)}
    shared = {
        f.name: getattr(source, f.name)
        for f in dataclasses.fields(cls)
        if f.init and f.name in theirs
    }
    return cls(**{**shared, **values})
