"""Damage a training checkpoint the way a user or a crash would: edit a field of its metadata,
or put a NaN into one of its tensors (``tests/train`` reads the refusals)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# a missing optional package skips the test modules that import this one, never fails collection
_st = pytest.importorskip(
    "safetensors",
    reason="safetensors is not installed (the inspect extra: pip install '.[inspect]')",
)
_st_torch = pytest.importorskip(
    "safetensors.torch",
    reason="safetensors is not installed (the inspect extra: pip install '.[inspect]')",
)
safe_open, load_file, save_file = _st.safe_open, _st_torch.load_file, _st_torch.save_file


def edit_checkpoint(
    path: Path, *, nan_in: str | None = None, drop: str | None = None, **fields: str
) -> None:
    """Rewrite the safetensors file at ``path``: metadata ``fields`` replaced, the field
    ``drop`` removed, and one value of the tensor ``nan_in`` set to NaN."""
    with safe_open(str(path), framework="pt") as f:
        metadata: dict[str, str] = dict(f.metadata())
    tensors = load_file(str(path))
    if nan_in is not None:
        tensors[nan_in].view(-1)[0] = torch.nan
    metadata.update(fields)
    if drop is not None:
        del metadata[drop]
    save_file(tensors, str(path), metadata=metadata)


def flip_bit(path: Path, tensor: str, bit: int = 0) -> None:
    """Flip bit ``bit`` of the first byte of ``tensor``'s payload, in place, as a damaged disk
    would: the header (and the checksums in it) stay as they were. Bit 0 of the first byte is the
    lowest mantissa bit of a little-endian float, so the value stays finite."""
    import json
    import struct

    data = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    begin, _ = header[tensor]["data_offsets"]
    data[8 + size + begin] ^= 1 << bit
    path.write_bytes(bytes(data))
