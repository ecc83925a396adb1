"""A mask spec taken apart into what a ``torch.library`` custom op takes, and made again.

An op cannot take a mask spec (a Python object), so :func:`flatten` (traced by Dynamo: it only
reads attributes) turns one into what an op takes: its tensors, its ints (symbolic under dynamic
shapes), its floats, and a string for the rest (the classes and the ``None``/``bool``/``str``
constants). :func:`rebuild` makes the same spec again inside the op. Each class says what it is
made of (:meth:`MaskSpec.compile_fields <attnkit.masks.MaskSpec.compile_fields>`) and how it is
made again from that (:meth:`MaskSpec.from_fields <attnkit.masks.MaskSpec.from_fields>`). The
string is a constant of the graph: a spec of another structure compiles another graph, as any
constant does.

>>> from attnkit.masks import causal, sliding_window
>>> spec = causal() & sliding_window(4)
>>> tensors, ints, floats, structure = flatten(spec)
>>> 4 in ints, repr(rebuild(tensors, ints, floats, structure))
(True, 'causal() & sliding_window(4)')
"""

from __future__ import annotations

import ast
import functools
import importlib
import sys
from typing import Any

import torch

from attnkit.masks.spec import MaskSpec

__all__ = ["flatten", "rebuild"]


def _flatten_node(
    spec: MaskSpec, tensors: list[torch.Tensor], ints: list[Any], floats: list[float]
) -> tuple[Any, ...] | str:
    """One spec as ``(module, class name, ((field, kind, payload), ...))``; kinds: ``t``
    tensor, ``i`` int, ``f`` float (payloads: indices into the lists), ``s`` a spec (payload:
    its node), ``c`` a ``None``/``bool``/``str`` constant (payload: the value). A string:
    why the spec cannot be taken apart."""
    cls = type(spec)
    if "<locals>" in cls.__qualname__:
        return f"its class {cls.__qualname__} is defined inside a function"
    items: list[tuple[str, str, Any]] = []
    for name, value in spec.compile_fields().items():
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            items.append((name, "t", len(tensors) - 1))
        elif isinstance(value, MaskSpec):
            node = _flatten_node(value, tensors, ints, floats)
            if isinstance(node, str):
                return node
            items.append((name, "s", node))
        elif value is None or isinstance(value, (bool, str)):
            items.append((name, "c", value))
        elif isinstance(value, (int, torch.SymInt)):
            ints.append(value)
            items.append((name, "i", len(ints) - 1))
        elif isinstance(value, float):
            floats.append(value)
            items.append((name, "f", len(floats) - 1))
        else:
            return f"{cls.__name__}.{name} is a {type(value).__name__}"
    return (cls.__module__, cls.__qualname__, tuple(items))


def flatten(
    spec: MaskSpec | None,
) -> tuple[list[torch.Tensor], list[Any], list[float], str] | str:
    """``(tensors, ints, floats, structure)``: ``spec`` in the form the op takes
    (``structure`` is ``""`` for no mask); or why it cannot be taken apart (a string: its
    class is local to a function, or a field is neither a tensor, a spec, a number, a
    string nor ``None``)."""
    tensors: list[torch.Tensor] = []
    ints: list[Any] = []
    floats: list[float] = []
    if spec is None:
        return tensors, ints, floats, ""
    node = _flatten_node(spec, tensors, ints, floats)
    if isinstance(node, str):
        return node
    return tensors, ints, floats, repr(node)


@functools.lru_cache(maxsize=256)
def _parse(structure: str) -> Any:
    return ast.literal_eval(structure)


@functools.lru_cache(maxsize=256)
def _class(module: str, qualname: str) -> type[MaskSpec]:
    obj: Any = sys.modules.get(module) or importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, MaskSpec)):
        raise TypeError(f"{module}.{qualname} is not a MaskSpec class")
    return obj


def _rebuild_node(
    node: Any, tensors: list[torch.Tensor], ints: list[int], floats: list[float]
) -> MaskSpec:
    module, qualname, items = node
    values: dict[str, list[Any]] = {"t": tensors, "i": ints, "f": floats}
    fields: dict[str, Any] = {}
    for name, kind, payload in items:
        if kind == "s":
            fields[name] = _rebuild_node(payload, tensors, ints, floats)
        elif kind == "c":
            fields[name] = payload
        else:
            fields[name] = values[kind][payload]
    return _class(module, qualname).from_fields(fields)


def rebuild(
    tensors: list[torch.Tensor], ints: list[int], floats: list[float], structure: str
) -> MaskSpec | None:
    """The spec :func:`flatten` took apart (with these tensors and numbers)."""
    if not structure:
        return None
    return _rebuild_node(_parse(structure), tensors, ints, floats)
