"""The ``attnkit`` command line: one file per group of commands, registered on one app.

Command modules import only typer at the top; torch-heavy or optional libraries (matplotlib,
transformers, the model weights) are imported inside the commands that need them, so
``attnkit --help`` starts fast.
"""

from __future__ import annotations

from attnkit.cli import walkthrough  # noqa: F401  (registers its commands)
from attnkit.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point."""
    app()
