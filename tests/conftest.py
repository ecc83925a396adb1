"""Shared test set-up: the hypothesis profiles, and `tests/` on sys.path for `oracle`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
