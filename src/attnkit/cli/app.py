"""The shared Typer application that every command module registers on, and its error handling.

Register commands with :func:`command` (not ``app.command``): it adds the one error path of the
CLI. An :class:`~attnkit.AttentionInputError` raised inside a command becomes one line on stderr,
``attnkit: error: <problem> (fix: <fix>)``, and exit code 2, never a traceback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import typer

from attnkit.errors import AttentionInputError

__all__ = ["EXIT_USER_ERROR", "app", "command", "error_line", "one_line_errors"]

EXIT_USER_ERROR = 2  # the exit code click gives usage errors too

app = typer.Typer(
    name="attnkit",
    help="Self-attention for PyTorch: correct, fast, and easy to look inside.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

F = TypeVar("F", bound=Callable[..., Any])


def error_line(e: AttentionInputError) -> str:
    """``attnkit: error: <problem> (fix: <fix>)``, on one line whatever the message holds."""
    problem = " ".join(e.problem.split())
    fix = f" (fix: {' '.join(e.fix.split())})" if e.fix else ""
    return f"attnkit: error: {problem}{fix}"


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Turn an :class:`~attnkit.AttentionInputError` into its one line on stderr and exit 2."""
    try:
        yield
    except AttentionInputError as e:
        typer.echo(error_line(e), err=True)
        raise typer.Exit(EXIT_USER_ERROR) from None


def command(name: str | None = None, **kwargs: Any) -> Callable[[F], F]:
    """``@command()``: register a function on :data:`app`, inside :func:`one_line_errors`."""

    def register(func: F) -> F:
        @functools.wraps(func)
        def guarded(*args: Any, **kw: Any) -> Any:
            with one_line_errors():
                return func(*args, **kw)

        app.command(name, **kwargs)(guarded)
        return func

    return register
