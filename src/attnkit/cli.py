"""The ``attnkit`` command line: ``attnkit demo`` (more commands join as they land)."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="attnkit",
    help="Self-attention for PyTorch: correct, fast, and easy to look inside.",
    no_args_is_help=True,
    add_completion=False,
)


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


def main() -> None:
    """Console-script entry point."""
    app()
