"""``attnkit demo`` and ``attnkit version``."""

from __future__ import annotations

import typer

from attnkit.cli.app import command
from attnkit.cli.inspect import DEFAULT_OUT, OutOption, run_show
from attnkit.inspect.show import DEFAULT_TEXT, MODEL_NAME, check_out_dir


@command()
def demo(out: OutOption = DEFAULT_OUT) -> None:
    """Seed 003's walk-through on "Life is short, eat dessert first", then `show` on it."""
    from attnkit.walkthrough import life_is_short

    check_out_dir(out)  # before the walk-through: a bad --out fails at once
    for line in life_is_short().lines:
        typer.echo(line)
    typer.echo("")
    typer.echo(f"The same sentence through a real pre-trained model, {MODEL_NAME} (attnkit show):")
    typer.echo("")
    result = run_show(DEFAULT_TEXT, out, truncate=False, layer=0, head=0)
    typer.echo("")
    typer.echo(f"open {result.paths['html'].resolve()} in a browser to explore every head.")


@command()
def version() -> None:
    """Print attnkit's and torch's versions."""
    import torch

    import attnkit

    typer.echo(f"attnkit {attnkit.__version__}, torch {torch.__version__}")
