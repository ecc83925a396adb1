"""The input check every model shares: ``input_ids (B, T)``, integer ids inside the vocabulary.

Dimension legend: B batch, T tokens, V vocabulary size.

>>> import torch
>>> check_token_ids("attnkit.models.GPT", torch.tensor([[0, 7]]), vocab_size=8)
>>> check_token_ids("attnkit.models.GPT", torch.tensor([[0, 8]]), vocab_size=8)
Traceback (most recent call last):
    ...
attnkit.errors.AttentionInputError: attnkit.models.GPT: token ids must be in [0, 8).
  got:      ids from 0 to 8
  expected: 0 <= id < vocab_size = 8
"""

from __future__ import annotations

from attnkit.errors import AttentionInputError, is_int_tensor, tensor_got
from attnkit.validate import can_read_values

__all__ = ["check_token_ids"]

UNSQUEEZE = "add a batch dim with input_ids.unsqueeze(0)"


def check_token_ids(
    where: str, input_ids: object, vocab_size: int, *, source: str | None = None
) -> None:
    """Raise an :class:`~attnkit.AttentionInputError` unless ``input_ids`` is ``(B, T)`` integer
    ids in ``[0, vocab_size)``.

    ``where`` names the model in the message; ``source``, when given, says where valid ids come
    from and opens the fix of a wrong-rank or wrong-dtype input.
    """
    if not is_int_tensor(input_ids) or input_ids.dim() != 2:
        raise AttentionInputError(
            where,
            "input_ids",
            "`input_ids` must be a 2-D tensor of integer token ids.",
            got=tensor_got("input_ids", input_ids, ("B", "T")),
            expected="input_ids (B, T), int64",
            fix=UNSQUEEZE if source is None else f"{source}; {UNSQUEEZE}",
        )
    if not input_ids.numel() or not can_read_values(input_ids):  # a compiled graph reads none
        return
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size:
        raise AttentionInputError(
            where,
            "input_ids",
            f"token ids must be in [0, {vocab_size}).",
            got=f"ids from {int(input_ids.min())} to {int(input_ids.max())}",
            expected=f"0 <= id < vocab_size = {vocab_size}",
        )
