"""Damage a training checkpoint the way a user or a crash would: edit a field of its metadata,
put a NaN into one of its tensors or flip a bit of one (``tests/train`` reads the refusals); and
a tiny run to damage, with the command line's one error line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from click.testing import Result

from attnkit.train import TrainConfig

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


#: a run that trains in a second or two: reversal of 8 letters, one layer of width 32, a
#: checkpoint every 2 of its 10 steps
TINY_RUN = TrainConfig(
    task="reverse",
    length=8,
    vocab=8,
    dim=32,
    num_layers=1,
    num_heads=2,
    batch_size=64,
    lr=1e-2,
    warmup=10,
    steps=10,
    eval_every=10,
    eval_size=500,
    test_size=1000,
    target=None,
    checkpoint_every=2,
)


def copy_run(made: Path, tmp_path: Path) -> Path:
    """A copy of the run directory ``made`` at ``tmp_path / "run"``."""
    out = tmp_path / "run"
    shutil.copytree(made, out)
    return out


def one_line_error(result: Result) -> str:
    """The command's one error line: exit 2, no traceback, only progress lines before it."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("attnkit: error: ")]
    assert len(errors) == 1, result.stderr
    assert lines[-1] == errors[0]  # before it only the progress lines of a run that trained
    assert all(line.startswith("attnkit: step ") for line in lines[:-1]), result.stderr
    return lines[-1]
