"""The CPU paths of :mod:`attnkit.cpu` a test forces, and :func:`use_path`, which forces one
or skips with the reason this CPU cannot run it.

``native-simulated`` runs the ``native`` path's code on any CPU by reporting avx512_bf16 and
avx512_fp16 in :func:`attnkit.cpu.features` (the input-dtype tensors go through the backends and
torch's kernels, only slowly without the instructions): numbers and no crash, not speed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnkit import cpu

PATHS = ["native", "fp32-upcast", "torch", "native-simulated"]


def use_path(monkeypatch: pytest.MonkeyPatch, path: str, dtype: torch.dtype) -> None:
    """Force ``path`` for ``dtype`` calls, or skip with the reason this CPU cannot run it."""
    if path == "native-simulated":
        f = cpu.features()
        flags = f.flags | {"avx512_bf16", "avx512_fp16"}
        fake = dataclasses.replace(f, flags=flags)
        monkeypatch.setattr(cpu, "features", lambda: fake)
        path = "native"
    reason = cpu.unavailable(path, dtype)
    if reason is not None:
        pytest.skip(f"the {path} path cannot run {dtype} here: {reason}")
    monkeypatch.setenv(cpu.ENV, path)
