"""The shared Typer application that every command module registers on."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="attnkit",
    help="Self-attention for PyTorch: correct, fast, and easy to look inside.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
