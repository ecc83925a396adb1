"""Training checkpoints as one safetensors file: model and optimizer tensors, JSON metadata.

A checkpoint holds

- ``model.<name>``: every tensor of the model's ``state_dict``;
- ``optim.<i>.<key>``: every tensor of the optimizer's state (AdamW: ``step``, ``exp_avg``,
  ``exp_avg_sq`` of parameter ``i``);
- metadata (strings): ``format``, ``step`` (optimizer steps done), ``finished``, ``config`` (the
  run's settings, JSON), ``optim.param_groups`` (JSON) and ``optim.scalars`` (non-tensor state,
  JSON).

That is all a run's state: its data is a function of (seed, step) (see
:mod:`attnkit.train.loop`), so no RNG state needs saving. Loading copies every tensor back
exactly (``torch.equal`` holds for all of them).

A checkpoint never holds a NaN or an infinity: :func:`save_checkpoint` refuses to write one
(the previous checkpoint stays), and :func:`load_checkpoint` and :func:`verify_checkpoint`
refuse to load one, naming the tensor. Metadata that does not parse (an edited file) is refused
with what is wrong, never a traceback.

**Checksums.** The metadata field ``checksums`` holds the SHA-256 of every tensor's bytes (a
JSON object, tensor name to hex digest), computed when saving. :func:`load_checkpoint` and
:func:`verify_checkpoint` (so ``--resume``) recompute them and refuse a tensor whose bytes
changed, naming it: one flipped bit in a weight is caught. A checkpoint written before
checksums existed still loads, with one :class:`UncheckedCheckpointWarning`; its next save
adds them.

**Writing.** A checkpoint is written with :func:`attnkit.files.replacing`: to a new temporary
file next to it, synced, then moved into place, so an interrupted or failed save (a full disk:
one :class:`~attnkit.files.WriteError`, "no space left on device while writing ...; the
previous checkpoint is intact") never leaves a broken checkpoint, and a symbolic link planted
at the checkpoint's name is replaced, never written through. A temporary file that a killed
save left behind (``.checkpoint.safetensors.*.tmp``, or ``checkpoint.safetensors.tmp`` from
older versions) is removed by the next save or load of that checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnkit import files
from attnkit.errors import AttentionInputError

__all__ = [
    "CHECKPOINT_NAME",
    "FORMAT",
    "CheckpointInfo",
    "UncheckedCheckpointWarning",
    "load_checkpoint",
    "non_finite",
    "read_info",
    "save_checkpoint",
    "verify_checkpoint",
]

CHECKPOINT_NAME = "checkpoint.safetensors"
FORMAT = "attnkit.train/1"
CHECKSUMS = "checksums"  # the metadata field: {tensor name: SHA-256 of its bytes, hex}


class UncheckedCheckpointWarning(UserWarning):
    """A checkpoint without checksums (written by an older attnkit): it loads, but damage to
    its tensors' bytes cannot be detected."""


@dataclass(frozen=True)
class CheckpointInfo:
    """The metadata of a checkpoint: ``step`` done, whether the run ``finished``, its ``config``."""

    path: Path
    step: int
    finished: bool
    config: dict[str, Any]


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    step: int,
    finished: bool,
    config: Mapping[str, Any],
) -> Path:
    """Write ``model`` and ``optimizer`` (and the run's ``step``, ``finished``, ``config``).

    Raises :class:`~attnkit.files.WriteError` when the file cannot be written (a full disk, no
    permission); the previous checkpoint at ``path`` is then intact.
    """
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    state = optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for index, param_state in state["state"].items():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{index}.{key}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    metadata = {
        "format": FORMAT,
        "step": str(step),
        "finished": json.dumps(finished),
        "config": json.dumps(dict(config), sort_keys=True),
        "optim.param_groups": json.dumps(state["param_groups"]),
        "optim.scalars": json.dumps(scalars),
    }
    path = Path(path)
    bad = non_finite(tensors)
    if bad is not None:
        raise AttentionInputError(
            "attnkit.train.save_checkpoint",
            "model",
            f"{bad}: a checkpoint never holds one, so {path} was not written.",
            got=bad,
            expected="finite model and optimizer tensors",
            fix="keep the last checkpoint; the training diverged before this step",
        )
    on_cpu = {k: v.cpu() for k, v in tensors.items()}
    metadata[CHECKSUMS] = json.dumps({k: _digest(v) for k, v in on_cpu.items()})
    where = "attnkit.train.save_checkpoint"
    files.check_directory(path.parent, where=where, argument="path")
    _remove_stale(path)  # first: a full disk gets their room back
    with files.replacing(path, where=where, argument="path", what="checkpoint") as tmp:
        _save_file(on_cpu, tmp, metadata)
    return path


def _save_file(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file``, its I/O errors (a Rust error naming ``os error 28``
    for a full disk) raised as the :class:`OSError` they are."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        number = files.errno_of(str(e))
        if number is None:
            raise
        raise OSError(number, os.strerror(number), str(path)) from e


def _digest(t: torch.Tensor) -> str:
    """SHA-256 of the bytes safetensors stores for ``t`` (C order, little-endian), hex."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.data).hexdigest()


def _remove_stale(path: Path) -> None:
    """Remove the temporary files of saves of ``path`` that were killed before moving them."""
    stale = [_tmp(path), *path.parent.glob(f".{glob_escape(path.name)}.*.tmp")]
    for p in stale:
        with suppress(OSError):
            p.unlink(missing_ok=True)  # a link is removed, never followed


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """Says which tensor holds a NaN or an infinity (the first one), or ``None``.

    >>> non_finite({"a": torch.zeros(3), "b": torch.tensor([1.0, float("nan"), float("inf")])})
    'tensor b (3,) holds 1 NaN and 1 inf of its 3 values'
    """
    for name, t in tensors.items():
        if not t.is_floating_point():
            continue
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            nan = int(torch.isnan(t).sum())
            inf = t.numel() - int(finite.sum()) - nan
            size = f"{tuple(t.shape)} holds {nan} NaN and {inf} inf of its {t.numel()} values"
            return f"tensor {name} {size}"
    return None


def _open_error(path: Path, problem: str, fix: str) -> AttentionInputError:
    return AttentionInputError(
        "attnkit.train.load_checkpoint",
        "checkpoint",
        problem,
        got=str(path),
        expected=f"a {CHECKPOINT_NAME} written by attnkit train",
        fix=fix,
    )


def _metadata(path: Path) -> dict[str, str]:
    from safetensors import SafetensorError, safe_open

    if path.is_dir() and (path / CHECKPOINT_NAME).is_file():
        raise _open_error(
            path,
            f"{path} is a run's directory, not its checkpoint.",
            f"pass {path / CHECKPOINT_NAME}",
        )
    if not path.is_file():
        raise _open_error(
            path,
            f"there is no checkpoint at {path}.",
            "run without --resume first, or pass the --out directory of that run",
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata: dict[str, str] | None = f.metadata()
    except (SafetensorError, OSError) as e:
        raise _open_error(
            path, f"{path} is not a readable safetensors file ({e}).", "start a new run"
        ) from None
    if not metadata or metadata.get("format") != FORMAT:
        found = (metadata or {}).get("format")
        raise _open_error(
            path,
            f"{path} is not an attnkit train checkpoint (format {found!r}, expected {FORMAT!r}).",
            "start a new run in an empty --out directory",
        )
    return metadata


def _bad_field(path: Path, meta: Mapping[str, str], key: str, what: str) -> AttentionInputError:
    value = meta.get(key)
    shown = "missing" if value is None else repr(value if len(value) <= 40 else value[:40] + "...")
    return _open_error(
        path,
        f"{path}: its metadata field {key!r} is {shown}, not {what} (the file was edited or "
        "damaged).",
        "resume from an intact copy, or start a new run with --overwrite",
    )


def _json(path: Path, meta: Mapping[str, str], key: str, kind: type, what: str) -> Any:
    try:
        value = json.loads(meta[key])
    except (KeyError, ValueError):
        raise _bad_field(path, meta, key, what) from None
    if not isinstance(value, kind):
        raise _bad_field(path, meta, key, what)
    return value


def _parse(path: Path, meta: Mapping[str, str]) -> tuple[CheckpointInfo, list[Any], dict[str, Any]]:
    """The checkpoint's info, optimizer param groups and scalars, every field checked."""
    step = meta.get("step", "")
    if not step.isdigit():  # digits only: an int >= 0
        raise _bad_field(path, meta, "step", "a number of steps (an int >= 0)")
    finished = _json(path, meta, "finished", bool, "true or false")
    config = _json(path, meta, "config", dict, "a JSON object of settings")
    groups = _json(path, meta, "optim.param_groups", list, "a JSON list of param groups")
    if not all(isinstance(g, dict) for g in groups):
        raise _bad_field(path, meta, "optim.param_groups", "a JSON list of param groups")
    scalars = _json(path, meta, "optim.scalars", dict, "a JSON object of optimizer state")
    if not all(k.isdigit() and isinstance(v, dict) for k, v in scalars.items()):
        raise _bad_field(path, meta, "optim.scalars", "a JSON object of optimizer state")
    return CheckpointInfo(path, int(step), finished, config), groups, scalars


def read_info(path: str | os.PathLike[str]) -> CheckpointInfo:
    """The metadata of the checkpoint at ``path``, without loading its tensors."""
    path = Path(path)
    return _parse(path, _metadata(path))[0]


def _tensors(path: Path, meta: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path`` (on the CPU); refuses a non-finite one and
    one that does not match its checksum in ``meta`` (the checkpoint's metadata)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    _remove_stale(path)  # left by an interrupted save
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise _open_error(
            path, f"{path} is not a readable safetensors file ({e}).", "start a new run"
        ) from None
    bad = non_finite(tensors)
    if bad is not None:
        raise _open_error(
            path,
            f"{path}: {bad}; training on would spread it to every weight.",
            "resume from an intact copy, or start a new run with --overwrite",
        )
    _check_sums(path, meta, tensors)
    return tensors


def _check_sums(path: Path, meta: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> None:
    """Each tensor's bytes against its SHA-256 in ``meta``; none there: one warning."""
    if CHECKSUMS not in meta:
        warnings.warn(
            f"{path} has no checksums (written by an older attnkit): damage to its tensors "
            "cannot be detected; the next save of the run adds them.",
            UncheckedCheckpointWarning,
            stacklevel=2,
        )
        return
    what = "a JSON object of SHA-256 digests, one per tensor"
    sums = _json(path, meta, CHECKSUMS, dict, what)
    if not all(isinstance(v, str) and len(v) == 64 for v in sums.values()):
        raise _bad_field(path, meta, CHECKSUMS, what)
    fix = "resume from an intact copy, or start a new run with --overwrite"
    unsummed, missing = sorted(tensors.keys() - sums.keys()), sorted(sums.keys() - tensors.keys())
    if unsummed:
        problem = f"{path}: tensor {unsummed[0]} has no checksum (the file was edited)."
        raise _open_error(path, problem, fix)
    if missing:
        problem = f"{path}: tensor {missing[0]} is missing (the file was edited or damaged)."
        raise _open_error(path, problem, fix)
    for name, t in tensors.items():
        if _digest(t) != sums[name]:
            raise _open_error(
                path,
                f"{path}: tensor {name} {tuple(t.shape)} does not match its checksum: its "
                "bytes changed after it was saved (the file is damaged).",
                fix,
            )


def verify_checkpoint(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Check the checkpoint at ``path`` as :func:`load_checkpoint` would, without a model:
    its metadata, that every tensor is finite and matches its checksum. Returns its metadata.

    A checkpoint without checksums (an older attnkit's) passes with an
    :class:`UncheckedCheckpointWarning`.
    """
    path = Path(path)
    meta = _metadata(path)
    info = _parse(path, meta)[0]
    _tensors(path, meta)
    return info


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> CheckpointInfo:
    """Copy the checkpoint at ``path`` into ``model`` (and ``optimizer``); return its metadata.

    The model and optimizer must be built as they were when saved (same sizes, same parameter
    order); tensors go to the device of the model's parameters. Every tensor is checked first:
    finite, and matching its checksum (see the module's docstring).
    """
    path = Path(path)
    meta = _metadata(path)
    info, groups, scalars = _parse(path, meta)
    tensors = _tensors(path, meta)  # on the CPU; load_state_dict copies to the params' device
    model_state = {
        k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")
    }
    try:
        model.load_state_dict(model_state, strict=True)
    except RuntimeError as e:
        raise _open_error(
            path,
            f"the checkpoint does not fit this model: {' '.join(str(e).split())[:300]}",
            "build the model with the config stored in the checkpoint",
        ) from None
    if optimizer is not None:
        try:
            _load_optimizer(optimizer, tensors, groups, scalars)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise _open_error(
                path,
                f"the checkpoint's optimizer state does not fit this optimizer "
                f"({type(e).__name__}: {' '.join(str(e).split())[:200]}).",
                "resume from an intact copy, or start a new run with --overwrite",
            ) from None
    return info


def _load_optimizer(
    optimizer: torch.optim.Optimizer,
    tensors: Mapping[str, torch.Tensor],
    groups: list[Any],
    scalars: Mapping[str, Any],
) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    for index, values in scalars.items():
        state.setdefault(int(index), {}).update(values)
    for saved, current in zip(groups, optimizer.param_groups, strict=True):
        for key, value in current.items():  # JSON turned tuples (betas) into lists
            if isinstance(value, tuple) and isinstance(saved.get(key), list):
                saved[key] = tuple(saved[key])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
