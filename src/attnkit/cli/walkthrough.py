"""``attnkit demo`` and ``attnkit version``."""

from __future__ import annotations

import typer

from attnkit.cli.app import app


@app.command()
def demo() -> None:
    """Seed 003's walk-through on "Life is short, eat dessert first", with every shape."""
    from attnkit.walkthrough import life_is_short

    for line in life_is_short().lines:
        typer.echo(line)


@app.command()
def version() -> None:
    """Print attnkit's and torch's versions."""
    import torch

    import attnkit

    typer.echo(f"attnkit {attnkit.__version__}, torch {torch.__version__}")
