"""Shared test set-up: the hypothesis profiles, `tests/` on sys.path for `oracle`, and the
skip of the ``cuda`` tier (tests marked ``cuda``) on a machine without a usable GPU.

Layout: ``tests/<pkg>/`` tests ``src/attnkit/<pkg>/``; ``tests/core/`` the top-level modules
(functional, cpu, heads, memory, files, model_dir, configs, walkthrough) and the package as a
whole (README, pyproject); ``tests/validation/`` every bad-input test (attention, explain, the
modules); ``tests/cuda/`` the CUDA tier; helpers shared by several directories sit in
``tests/`` itself (oracle, strategies, validation_cases, checkpoints, block_imports)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

# "ci" is what `make test` runs; "dev" is quicker for local iteration.
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", parent=settings.get_profile("ci"), max_examples=20)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ARTIFACTS = Path(
    os.environ.get("ATTNKIT_TEST_ARTIFACTS", Path(__file__).parent.parent / "test-artifacts")
)


def cuda_missing() -> str | None:
    """Why the ``cuda`` tier cannot run here, or ``None`` when it can."""
    if torch.cuda.is_available():
        return None
    build = torch.version.cuda
    what = f"built for CUDA {build}, but no GPU is visible" if build else "a CPU-only build"
    return (
        f"needs a CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, {what})"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are skipped, with the reason, where no GPU is available."""
    reason = cuda_missing()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
