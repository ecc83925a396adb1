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
with what is wrong, never a traceback. Files are written to ``<name>.tmp`` and moved into place,
so an interrupted save never leaves a broken checkpoint; a ``.tmp`` that an interrupted save
left behind is removed by the next save or load of that checkpoint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnkit.errors import AttentionInputError

__all__ = [
    "CHECKPOINT_NAME",
    "FORMAT",
    "CheckpointInfo",
    "load_checkpoint",
    "non_finite",
    "read_info",
    "save_checkpoint",
    "verify_checkpoint",
]

CHECKPOINT_NAME = "checkpoint.safetensors"
FORMAT = "attnkit.train/1"


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
    """Write ``model`` and ``optimizer`` (and the run's ``step``, ``finished``, ``config``)."""
    from safetensors.torch import save_file

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
    tmp = _tmp(path)
    tmp.unlink(missing_ok=True)  # left by an interrupted save
    try:
        save_file({k: v.cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


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


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path`` (on the CPU); refuses a non-finite one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    _tmp(path).unlink(missing_ok=True)  # left by an interrupted save
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
    return tensors


def verify_checkpoint(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Check the checkpoint at ``path`` as :func:`load_checkpoint` would, without a model:
    its metadata and that every tensor is finite. Returns its metadata."""
    path = Path(path)
    info = _parse(path, _metadata(path))[0]
    _tensors(path)
    return info


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> CheckpointInfo:
    """Copy the checkpoint at ``path`` into ``model`` (and ``optimizer``); return its metadata.

    The model and optimizer must be built as they were when saved (same sizes, same parameter
    order); tensors go to the device of the model's parameters.
    """
    path = Path(path)
    info, groups, scalars = _parse(path, _metadata(path))
    tensors = _tensors(path)  # on the CPU; load_state_dict copies to the params' device
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
