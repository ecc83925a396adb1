"""The shared Typer application that every command module registers on, and its error handling.

Register commands with :func:`command` (not ``app.command``): it adds the one error path of the
CLI. An :class:`~attnkit.AttentionInputError` raised inside a command becomes one line on stderr,
``attnkit: error: <problem> (fix: <fix>)``, and exit code 2, never a traceback. Commands check
their options, output paths included (:func:`check_output_file`), before any work, so a bad
option never costs a run.
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import typer
from typer.core import TyperCommand, TyperGroup

from attnkit.errors import AttentionInputError

__all__ = [
    "EXIT_USER_ERROR",
    "app",
    "check_output_file",
    "command",
    "error_line",
    "one_line_errors",
]

EXIT_USER_ERROR = 2  # the exit code click gives usage errors too


def _plain_flags(params: list[Any]) -> list[Any]:
    """Flags take no value, so their help shows no type (typer would print ``<bool>``)."""
    for param in params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    return params


class _Command(TyperCommand):
    # typer's own click (vendored from 0.20 on) or click: the parameters are typed loosely
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_flags(super().get_params(ctx))


class _Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_flags(super().get_params(ctx))


app = typer.Typer(
    name="attnkit",
    cls=_Group,
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

        app.command(name, cls=_Command, **kwargs)(guarded)
        return func

    return register


# ---------------------------------------------------------------------------------------------
# output paths, checked before any work


def _path_error(
    where: str, option: str, path: Path | str, problem: str, expected: str, fix: str
) -> AttentionInputError:
    return AttentionInputError(
        where, option, f"{option} {problem}", got=f"{option} {path}", expected=expected, fix=fix
    )


def check_output_file(where: str, option: str, path: Path) -> None:
    """Refuse an output file that cannot be written: its directory missing, not a directory or
    reached through a link another user planted (:func:`attnkit.files.check_directory`), the
    path a directory, no permission, or an existing file that is read-only. Probes with a
    temporary file in the directory (removed again); ``path`` itself is never opened, so a link
    there is never followed (the writer replaces it, see :mod:`attnkit.files`).

    >>> check_output_file("attnkit bench", "--json", Path("/nope/x.json"))
    Traceback (most recent call last):
    attnkit.errors.AttentionInputError: attnkit bench: --json /nope/x.json: the directory /nope ...
    """
    import tempfile

    from attnkit import files

    expected = "a file path in an existing, writable directory"
    if str(path) == "":
        raise _path_error(where, option, "''", "is empty.", expected, f"pass {option} FILE")
    parent = path.parent
    if path.is_dir() and not path.is_symlink():
        raise _path_error(
            where, option, path, f"{path} is a directory.", expected, f"pass {option} {path}/NAME"
        )
    if not parent.exists():
        raise _path_error(
            where,
            option,
            path,
            f"{path}: the directory {parent} does not exist.",
            expected,
            f"create it first (mkdir -p {parent}) or write somewhere else",
        )
    if not parent.is_dir():
        raise _path_error(
            where,
            option,
            path,
            f"{path}: {parent} is not a directory.",
            expected,
            "write into a directory",
        )
    try:
        files.check_directory(parent, where=where, argument=option)
        fd, name = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        os.unlink(name)
        read_only = path.is_file() and not path.is_symlink() and not os.access(path, os.W_OK)
        if read_only:
            raise PermissionError(errno.EACCES, "the file is read-only")
    except files.WriteError as e:
        raise _path_error(where, option, path, e.problem, expected, e.fix or "") from None
    except OSError as e:
        raise _path_error(
            where,
            option,
            path,
            f"{path} cannot be written ({e.strerror or e}).",
            expected,
            "write somewhere you have permission to",
        ) from None
