"""A checkpoint's weight names turned into an attnkit model's: the loop every mapping shares.

Each architecture says how one name maps (:func:`attnkit.models.hf_bert_state_dict`,
:func:`attnkit.interop.hf_gpt2_state_dict`); :func:`rename_weights` applies it to a whole state
dict and lists every name it does not know in one error.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch

from attnkit.errors import AttentionInputError

__all__ = ["rename_weights"]

Rename = Callable[[str, torch.Tensor], "dict[str, torch.Tensor] | None"]


def rename_weights(
    state_dict: Mapping[str, torch.Tensor],
    rename: Rename,
    *,
    where: str,
    model: str,
    prefix: str,
    ignored: re.Pattern[str],
    example: str,
) -> dict[str, torch.Tensor]:
    """``state_dict`` under attnkit's names.

    ``prefix`` is stripped from each name; a name that ``ignored`` matches is dropped;
    ``rename(name, tensor)`` gives the attnkit weights a name becomes, or ``None`` for a name
    it does not know. Unknown names raise an :class:`~attnkit.AttentionInputError` that lists
    them and names the ``model`` the names were expected from (a name like ``example``).

    >>> rename_weights({"m.w": torch.ones(1), "m.skip": torch.ones(1)},
    ...                lambda name, t: {name.upper(): t} if name == "w" else None,
    ...                where="example", model="M", prefix="m.", ignored=re.compile("skip"),
    ...                example="w")
    {'W': tensor([1.])}
    """
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for name, tensor in state_dict.items():
        key = name.removeprefix(prefix)
        if ignored.fullmatch(key):
            continue
        renamed = rename(key, tensor)
        if renamed is None:
            unknown.append(name)
        else:
            out.update(renamed)
    if unknown:
        raise AttentionInputError(
            where,
            "state_dict",
            f"{len(unknown)} weight name(s) are not Hugging Face {model} weights.",
            got=f"unexpected: {', '.join(unknown[:8])}" + (" ..." if len(unknown) > 8 else ""),
            expected=f"names like {example} (optionally with a {prefix} prefix)",
            fix=f"is this a {model} checkpoint? Other architectures need their own mapping",
        )
    return out
