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
exactly (``torch.equal`` holds for all of them). Files are written to a temporary name and moved
into place, so an interrupted save never leaves a broken checkpoint.
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
    "read_info",
    "save_checkpoint",
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
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path


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


def read_info(path: str | os.PathLike[str]) -> CheckpointInfo:
    """The metadata of the checkpoint at ``path``, without loading its tensors."""
    path = Path(path)
    return _info(path, _metadata(path))


def _info(path: Path, meta: dict[str, str]) -> CheckpointInfo:
    finished = bool(json.loads(meta["finished"]))
    return CheckpointInfo(path, int(meta["step"]), finished, json.loads(meta["config"]))


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> CheckpointInfo:
    """Copy the checkpoint at ``path`` into ``model`` (and ``optimizer``); return its metadata.

    The model and optimizer must be built as they were when saved (same sizes, same parameter
    order); tensors go to the device of the model's parameters.
    """
    from safetensors.torch import load_file

    path = Path(path)
    meta = _metadata(path)
    tensors = load_file(str(path))  # on the CPU; load_state_dict copies to the params' device
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
        state: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            if key.startswith("optim."):
                _, index, name = key.split(".", 2)
                state.setdefault(int(index), {})[name] = value
        for index, values in json.loads(meta["optim.scalars"]).items():
            state.setdefault(int(index), {}).update(values)
        groups = json.loads(meta["optim.param_groups"])
        for saved, current in zip(groups, optimizer.param_groups, strict=True):
            for key, value in current.items():  # JSON turned tuples (betas) into lists
                if isinstance(value, tuple) and isinstance(saved.get(key), list):
                    saved[key] = tuple(saved[key])
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    return _info(path, meta)
