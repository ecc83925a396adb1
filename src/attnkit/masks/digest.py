"""A mask spec's content digest: equal on two processes exactly when they hold the same mask.

:meth:`MaskSpec.digest <attnkit.masks.MaskSpec.digest>` hashes (BLAKE2b, 128 bits) what a
spec is made of: its class (module and qualified name) and, attribute by attribute in name
order, every value it holds. A tensor counts by its dtype, shape and bytes (read on the CPU;
not its device, so equal tensors on ``cuda:0`` and ``cuda:1`` agree), a spec inside it by its
own content, numbers, strings and ``None`` by their values, tuples, lists and dicts element by
element, and a function by its name, code, defaults and the values it closes over. Nothing
depends on the process: no ``id``, no address, no ``repr`` (a spec's repr shows a tensor's shape
only, so two ranks with different document ids would have agreed). An object of any other kind
counts by its type alone. Attributes a class names in ``digest_ignores`` (caches, such as a
dense mask's prefix sums) are left out.

Ring attention compares the digests of every rank's mask before any K/V moves
(:func:`attnkit.distributed.ring_attention`).
"""

from __future__ import annotations

import hashlib
import types
from typing import Any

import torch

__all__ = ["Digestible", "spec_digest", "tensor_bytes"]


class Digestible:
    """What has a content digest: every mask spec (:class:`~attnkit.masks.MaskSpec`)."""

    #: attributes that are caches or derived from others, not content: :meth:`digest` skips them
    digest_ignores: tuple[str, ...] = ()

    def digest(self) -> str:
        """A hex digest of the spec's content: its class and every value it holds, tensors by
        their dtype, shape and bytes (on any device). Two specs have the same digest exactly
        when they are the same rule over the same values, in any process; ring attention
        compares them across ranks (see :mod:`attnkit.masks.digest`).

        >>> import torch
        >>> from attnkit.masks import document
        >>> a, b = document(torch.tensor([0, 0, 1])), document(torch.tensor([0, 1, 1]))
        >>> repr(a) == repr(b), a.digest() == b.digest()
        (True, False)
        >>> a.digest() == document(torch.tensor([0, 0, 1])).digest()
        True
        """
        return spec_digest(self)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The values of ``t`` as bytes, in row-major order, read on the CPU (bool as 0/1 bytes;
    any dtype, bfloat16 and float8 included, viewed as raw bytes)."""
    x = t.detach()
    if x.layout != torch.strided:  # sparse: its values as a dense tensor
        x = x.to_dense()
    x = x.resolve_conj().resolve_neg().contiguous().reshape(-1).cpu()
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    raw: bytes = x.view(torch.uint8).numpy().tobytes()
    return raw


def spec_digest(spec: object) -> str:
    """The hex digest of ``spec``'s content (see the module docstring)."""
    h = hashlib.blake2b(digest_size=16)
    _feed(h, spec, set())
    return h.hexdigest()


def _name(x: Any) -> str:
    return f"{getattr(x, '__module__', '?')}.{getattr(x, '__qualname__', type(x).__name__)}"


def _feed(h: Any, x: object, seen: set[int]) -> None:
    """Add ``x`` to the hash ``h``; ``seen`` holds the containers being walked (cycles)."""
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
        h.update(f"{type(x).__name__}:{x!r};".encode())
    elif isinstance(x, (torch.dtype, torch.device)):
        h.update(f"{type(x).__name__}:{x};".encode())
    elif isinstance(x, torch.Tensor):
        h.update(f"tensor:{x.dtype}:{tuple(x.shape)}:".encode())
        if x.device.type == "meta":  # no values to read
            h.update(b"meta;")
        else:
            h.update(tensor_bytes(x))
            h.update(b";")
    elif id(x) in seen:  # a container inside itself
        h.update(b"cycle;")
    elif isinstance(x, Digestible):
        seen.add(id(x))
        cls = type(x)
        h.update(f"spec:{_name(cls)}(".encode())
        fields = vars(x)
        for name in sorted(fields):
            if name not in cls.digest_ignores:
                h.update(f"{name}=".encode())
                _feed(h, fields[name], seen)
        h.update(b");")
        seen.discard(id(x))
    elif isinstance(x, (tuple, list, dict, types.FunctionType, types.CodeType)):
        seen.add(id(x))
        _feed_container(h, x, seen)
        seen.discard(id(x))
    else:  # nothing attnkit can read the content of
        h.update(f"object:{_name(type(x))};".encode())


def _feed_container(h: Any, x: object, seen: set[int]) -> None:
    if isinstance(x, (tuple, list)):
        h.update(f"{type(x).__name__}:{len(x)}[".encode())
        for item in x:
            _feed(h, item, seen)
        h.update(b"];")
    elif isinstance(x, dict):
        h.update(f"dict:{len(x)}{{".encode())
        for key in sorted(x, key=repr):
            _feed(h, key, seen)
            _feed(h, x[key], seen)
        h.update(b"};")
    elif isinstance(x, types.FunctionType):
        h.update(f"function:{_name(x)}(".encode())
        _feed(h, x.__code__, seen)
        _feed(h, x.__defaults__, seen)
        _feed(h, x.__kwdefaults__, seen)
        _feed(h, [_cell(c) for c in x.__closure__ or ()], seen)
        h.update(b");")
    elif isinstance(x, types.CodeType):
        h.update(b"code:")
        h.update(x.co_code)
        _feed(h, x.co_names, seen)
        _feed(h, list(x.co_consts), seen)
        h.update(b";")


def _cell(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # a name the function closes over, not bound yet
        return "<unbound cell>"
