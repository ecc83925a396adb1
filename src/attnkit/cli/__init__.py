"""The ``attnkit`` command line: one file per group of commands, registered on one app.

Commands register with :func:`attnkit.cli.app.command`, which turns an
:class:`~attnkit.AttentionInputError` into one line on stderr and exit code 2. Command modules
import typer and attnkit's own modules at the top; optional libraries (matplotlib, the tokenizer,
the model weights, rich) are imported inside the commands that need them, so ``attnkit --help``
starts fast and never loads matplotlib or transformers.
"""

from __future__ import annotations

# Each import registers its commands; `attnkit --help` lists them in this order.
# isort: off
import attnkit.cli.bench  # bench
import attnkit.cli.train  # train
import attnkit.cli.inspect  # show, trace
import attnkit.cli.doctor  # doctor
import attnkit.cli.walkthrough  # noqa: F401  demo, version

# isort: on
from attnkit.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point."""
    app()
