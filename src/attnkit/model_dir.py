"""A model directory attnkit did not write: what it must hold before anything in it is read.

:func:`check_model_dir` is the one rule for every loader of a user's checkpoint directory
(``attnkit show --model DIR``, :func:`attnkit.models.load_bert`,
:func:`attnkit.models.load_tokenizer`): attnkit never runs code from such a directory, never
unpickles a file from it, and never follows a link in it. Before any file is read the directory's
own entries are checked, and the first problem found raises
:class:`~attnkit.AttentionInputError`, naming the file:

- a symbolic link (``config.json -> /elsewhere/config.json``), wherever it points, or an entry
  that is neither a regular file nor a directory (reading a FIFO would block);
- a JSON file that is not UTF-8 JSON (it could not be checked), or that asks for code: an
  ``auto_map`` or ``custom_pipelines`` key at any depth (``config.json``,
  ``tokenizer_config.json``, any other ``*.json``);
- Python code (``*.py``, ``*.pyc``, ``*.pyo``, ``*.pyd``, ``*.so``);
- a pickle (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``, ``*.pkl``, ``*.pickle``): weights are read
  only from safetensors;
- a safetensors index (``*.safetensors.index.json``) whose ``weight_map`` names a shard that is
  not a ``*.safetensors`` file of the directory itself.

Sub-directories are not read by the loaders and not checked. Every transformers load of a user's
directory passes :data:`HF_LOAD` as well (``trust_remote_code=False``: transformers refuses code
without asking, even where this check did not look; ``local_files_only=True``), and a model load
passes :data:`HF_WEIGHTS` (``use_safetensors=True``).

>>> import tempfile
>>> from pathlib import Path
>>> with tempfile.TemporaryDirectory() as d:
...     _ = (Path(d) / "config.json").write_text('{"auto_map": {"AutoModel": "evil.Model"}}')
...     check_model_dir(d, where="example", argument="model_dir")
Traceback (most recent call last):
attnkit.errors.AttentionInputError: example: .../config.json' asks to run code from the ...
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from attnkit.errors import AttentionInputError

__all__ = [
    "CODE_KEYS",
    "CODE_SUFFIXES",
    "HF_LOAD",
    "HF_WEIGHTS",
    "PICKLE_SUFFIXES",
    "check_model_dir",
]

#: keys of a JSON file in a model directory that make transformers import code from it
CODE_KEYS = ("auto_map", "custom_pipelines")
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyd", ".so")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
#: what every transformers ``from_pretrained`` of a user's directory passes
HF_LOAD: dict[str, Any] = {"trust_remote_code": False, "local_files_only": True}
#: what a transformers model load passes on top of :data:`HF_LOAD`: no pickled weights
HF_WEIGHTS: dict[str, Any] = {**HF_LOAD, "use_safetensors": True}
EXPECTED = "a model directory of plain files: no links, no code, no pickles"
NEVER = "attnkit never runs code from a model directory"
_SHOWN = 80  # characters of a JSON value quoted in a message


def _bad(where: str, argument: str, got: str, problem: str, fix: str) -> AttentionInputError:
    return AttentionInputError(where, argument, problem, got=got, expected=EXPECTED, fix=fix)


def _code_key(value: Any, path: str = "") -> tuple[str, Any] | None:
    """The first :data:`CODE_KEYS` key in a parsed JSON value, as ``(dotted path, its value)``."""
    if isinstance(value, dict):
        for key, item in value.items():
            dotted = f"{path}.{key}" if path else str(key)
            if key in CODE_KEYS:
                return dotted, item
            found = _code_key(item, dotted)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _code_key(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True)  # one line: newlines and controls escaped
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _json(file: Path) -> Any:
    """The parsed JSON of ``file``, or None when it is not UTF-8 JSON."""
    try:
        return json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None


def _bad_shard(weight_map: Any, root: Path) -> str | None:
    """The first shard name of an index's ``weight_map`` that is not a safetensors file of
    ``root`` itself (a path, ``..``, another suffix, missing), else None."""
    if not isinstance(weight_map, dict):
        return "its weight_map is not a JSON object"
    for shard in weight_map.values():
        if not isinstance(shard, str) or Path(shard).name != shard or "\\" in shard:
            return f"it names the shard {_shown(shard)}, which is not a file name"
        if not shard.endswith(".safetensors") or not (root / shard).is_file():
            return f"it names the shard {shard!r}, which is not a safetensors file of the directory"
    return None


def check_model_dir(
    model_dir: str | os.PathLike[str], *, where: str, argument: str, got: str | None = None
) -> Path:
    """``model_dir`` as a Path, once its entries are plain files without code or pickles.

    Raises :class:`~attnkit.AttentionInputError` (argument ``argument``, ``got`` or
    ``argument=model_dir``) for the first entry that breaks the module's rule: a link or special
    file, a JSON file that cannot be read or asks for code, a code file, a pickle, a shard index
    that points outside the directory, or a directory or file that cannot be read. The caller
    checks first that ``model_dir`` is a directory (a link given as ``model_dir`` itself is the
    user's own choice and is followed).
    """
    root = Path(model_dir)
    got = got if got is not None else f"{argument}={str(root)!r}"
    try:
        _check(root, where, argument, got)
    except OSError as e:
        raise _bad(
            where,
            argument,
            got,
            f"cannot read {str(e.filename or root)!r}: {e.strerror or e}.",
            "make the model directory and its files readable",
        ) from e
    return root


def _check(root: Path, where: str, argument: str, got: str) -> None:
    entries = sorted(root.iterdir(), key=lambda p: p.name)
    modes = {p: p.lstat().st_mode for p in entries}
    for p, mode in modes.items():
        if stat.S_ISLNK(mode):
            raise _bad(
                where,
                argument,
                got,
                f"{str(p)!r} is a symbolic link (to {os.readlink(p)!r}); attnkit never follows "
                "a link in a model directory.",
                "copy the file itself into the directory (cp --dereference), or save the model "
                "there again with save_pretrained",
            )
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise _bad(
                where,
                argument,
                got,
                f"{str(p)!r} is not a regular file (a FIFO, socket or device).",
                "remove it from the model directory",
            )
    files = [p for p, mode in modes.items() if stat.S_ISREG(mode)]
    parsed = {}
    for p in (p for p in files if p.suffix == ".json"):
        value = parsed[p] = _json(p)
        if value is None:
            raise _bad(
                where,
                argument,
                got,
                f"{str(p)!r} is not UTF-8 JSON, so it cannot be checked for code.",
                "replace it with the file save_pretrained writes, or remove it",
            )
        found = _code_key(value)
        if found is not None:
            key, item = found
            raise _bad(
                where,
                argument,
                got,
                f"{str(p)!r} asks to run code from the directory ({key}: {_shown(item)}); {NEVER}.",
                "use a model transformers itself implements, saved with save_pretrained; "
                "custom code runs only where you load it with transformers yourself",
            )
    for suffixes, problem, fix in (
        (CODE_SUFFIXES, f"is code; {NEVER}", "remove the code files from the model directory"),
        (
            PICKLE_SUFFIXES,
            "is a pickle; attnkit never unpickles a file from a model directory (weights are "
            "read only from *.safetensors)",
            "save the weights as safetensors (model.save_pretrained(DIR) does) and move the "
            "pickle files out of the directory",
        ),
    ):
        for p in files:
            if p.suffix in suffixes:
                raise _bad(where, argument, got, f"{str(p)!r} {problem}.", fix)
    for p, value in parsed.items():
        if p.name.endswith(".safetensors.index.json"):
            weight_map = value.get("weight_map") if isinstance(value, dict) else None
            bad = _bad_shard(weight_map, root)
            if bad is not None:
                raise _bad(
                    where,
                    argument,
                    got,
                    f"{str(p)!r} cannot be used: {bad}.",
                    "save the model there again with save_pretrained",
                )
