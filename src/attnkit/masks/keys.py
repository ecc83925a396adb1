"""A tensor's part of a mask spec's cache key."""

from __future__ import annotations

from collections.abc import Hashable

import torch

__all__ = ["tensor_key"]


def tensor_key(t: torch.Tensor) -> Hashable:
    """A tensor's part of a cache key: its identity and version (an in-place edit through
    torch bumps it) and, on the CPU, its values (dtype, shape and bytes), so that a write that
    bypasses torch's version counter (``t.data.copy_(...)``, a NumPy array sharing the memory)
    is seen too. Spec tensors are small (lengths, ids, one flag per key): the copy costs
    microseconds. On another device, reading the values would wait for the device, so a write
    that bypasses the counter is not seen there: edit a spec's tensor through torch, or build a
    new spec.

    The identity stays in the key because cached plans read the spec's own tensors when they
    run (flex's ``mask_mod``, lazily built tile masks): an entry must only ever be found by the
    tensor it was made from, holding the values it was made with. A cache that keys on it must
    hold the tensor (so that the id is not reused while the entry lives): plans keep
    :meth:`MaskSpec.tensors` alive.

    >>> t = torch.tensor([3, 5])
    >>> before = tensor_key(t)
    >>> t.data[0] = 4  # no version bump
    >>> tensor_key(t) == before
    False
    """
    if t.device.type != "cpu":
        return (str(t.device), id(t), t._version)
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.to(torch.uint8) if flat.dtype == torch.bool else flat.view(torch.uint8)
    return (id(t), t._version, t.dtype, tuple(t.shape), raw.numpy().tobytes())
