"""A mask function as a spec: :func:`from_function`.

Dimension legend: B batch, H query heads, L query length, S key length; ``b, h, q, kv`` are
indices; ``B'``, ``H'`` are 1 unless the function is declared to depend on the batch / head.

``fn(b, h, q_idx, kv_idx)`` returns a bool tensor, True = may attend: flex_attention's
``mask_mod`` convention, and the form transformers' mask functions take. It is called with
broadcastable int32 index tensors (as flex's kernels pass them; int32 arithmetic is a third
of int64's cost over L x S pairs), raw query and key indices: ``q_idx`` is the query's row,
not its end-aligned position, so a causal rule for ``L != S`` is ``kv_idx <= q_idx + S - L``.

Where a row's allowed keys are one run (a window, causal, documents), the run is found from
the function's values once (:meth:`FunctionMask.key_runs`, cached with the spec's key by the
row-span kernel's plan) and attnkit's row-span kernel runs it, as it runs the built-in rules.

Block states (empty / partial / full) come from evaluating ``fn`` on each block's tile, a
group of block rows at a time (at most :data:`CHUNK_PAIRS` pairs per call of ``fn``), never on
an ``L x S`` tensor at once; they are cached per function, captured tensors (their identity and
version, never their bytes), block grid and device, so that the layers of a model classify once.
The blocked backend then evaluates ``fn`` only inside partial blocks, a tile at a time.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from attnkit.errors import AttentionInputError
from attnkit.masks.base import spec_error
from attnkit.masks.function_runs import function_runs
from attnkit.masks.runs import Spans
from attnkit.masks.spec import MaskSpec

__all__ = [
    "CHUNK_PAIRS",
    "FunctionMask",
    "cache_info",
    "clear_cache",
    "from_function",
    "key_extent",
    "searched_keys",
]

MaskFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: (b, h, q, kv) pairs one call of the function evaluates at most while blocks are classified
CHUNK_PAIRS = 1 << 20

#: block states per (spec key, block grid, sizes, device): (spec, any, all)
_BOUNDS: OrderedDict[Hashable, tuple[MaskSpec, torch.Tensor, torch.Tensor]] = OrderedDict()
_BOUNDS_SIZE = 64
_STATS = {"hits": 0, "misses": 0}

#: the functions of live function masks by token: under ``torch.compile`` the custom op takes a
#: spec as tensors, numbers and strings, so a function mask passes its token (a constant of the
#: graph) and the op finds the function again (:meth:`FunctionMask.from_fields`)
_FUNCTIONS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_STRONG: dict[str, Any] = {}  # functions that take no weak reference
_TOKENS = itertools.count()
_Spec = TypeVar("_Spec", bound="FunctionMask")


#: the keys a :meth:`FunctionMask.key_runs` searches: ``(first global key, count)``, set by
#: :func:`attnkit.masks.row_spans` (a rule of formulas needs no key count; a function does)
_KEYS: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "attnkit_function_keys", default=None
)


@contextlib.contextmanager
def key_extent(k_start: int, S: int) -> Iterator[None]:
    """Within it, a function mask's :meth:`~FunctionMask.key_runs` searches keys ``k_start ..
    k_start + S - 1`` (outside it, it answers ``None``: not one run it can tell)."""
    token = _KEYS.set((k_start, S))
    try:
        yield
    finally:
        _KEYS.reset(token)


def searched_keys() -> tuple[int, int] | None:
    """The keys :func:`key_extent` names here, ``(first global key, count)``, or ``None``
    outside it (a spec made of parts, :func:`~attnkit.masks.concat_keys`, names each part's)."""
    return _KEYS.get()


def clear_cache() -> None:
    """Forget every cached classification of a function mask's blocks."""
    _BOUNDS.clear()
    _STATS.update(hits=0, misses=0)


def cache_info() -> dict[str, int]:
    """Hits, misses and entries of the block classification cache."""
    return {**_STATS, "size": len(_BOUNDS)}


def _captured(obj: Any, depth: int = 0) -> Hashable:
    """A key for what a function reads besides its arguments: code, closure cells, defaults,
    partial arguments, bound ``self``, and the tensors among its globals. Tensors enter as
    ``(id, version)`` (an in-place edit through torch bumps the version; their bytes are
    never copied); numbers, strings and ``None`` by value; anything else by identity."""
    if isinstance(obj, torch.Tensor):
        return ("t", id(obj), obj._version)
    if obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device)):
        return obj
    if depth > 4:
        return ("id", id(obj))
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, id(obj), *(_captured(x, depth + 1) for x in obj))
    if isinstance(obj, functools.partial):
        kw = tuple(sorted((k, _captured(v, depth + 1)) for k, v in obj.keywords.items()))
        return ("partial", _captured(obj.func, depth + 1), _captured(obj.args, depth + 1), kw)
    code = getattr(obj, "__code__", None)
    if code is None and hasattr(obj, "__func__"):  # a bound method
        return ("method", _captured(obj.__func__, depth + 1), _captured(obj.__self__, depth + 1))
    if code is None:
        return ("id", id(obj))
    cells = tuple(_captured(_cell(c), depth + 1) for c in obj.__closure__ or ())
    glob = getattr(obj, "__globals__", {})
    tensors = tuple(
        (n, _captured(glob[n])) for n in code.co_names if isinstance(glob.get(n), torch.Tensor)
    )
    return ("fn", code, cells, _captured(obj.__defaults__, depth + 1), tensors)


def _tensors_of(obj: Any, out: list[torch.Tensor], depth: int = 0) -> list[torch.Tensor]:
    """The tensors a function captures (its closure, defaults and partial arguments)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth <= 4 and isinstance(obj, (tuple, list)):
        for x in obj:
            _tensors_of(x, out, depth + 1)
    elif depth <= 4 and isinstance(obj, functools.partial):
        _tensors_of((obj.func, obj.args, tuple(obj.keywords.values())), out, depth + 1)
    elif depth <= 4 and callable(obj):
        cells = [_cell(c) for c in getattr(obj, "__closure__", None) or ()]
        _tensors_of((cells, getattr(obj, "__defaults__", None) or ()), out, depth + 1)
    return out


def _cell(cell: Any) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # a name the function closes over, not bound yet
        return "<unbound cell>"


def _register(fn: Any) -> str:
    token = f"{_name(fn)}#{next(_TOKENS)}"
    try:
        _FUNCTIONS[token] = fn
    except TypeError:  # no weak reference to it: held for the process
        _STRONG[token] = fn
    return token


def _name(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        return f"partial({_name(fn.func)})"
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__)


class FunctionMask(MaskSpec):
    """A mask rule given as a function of ``(b, h, q_idx, kv_idx)`` (see the module doc)."""

    scratch_bytes = 32  # what a typical function allocates per pair (int64 arithmetic)
    digest_ignores = ("token", "_tensors")  # process-local; derived from fn

    def __init__(self, fn: MaskFunction, batch: int | None, heads: int | None) -> None:
        self.fn = fn
        self.batch, self.heads = batch, heads
        self.token = _register(fn)
        self._derive()

    def _derive(self) -> None:
        self._tensors = _tensors_of(self.fn, [])

    def key(self) -> Hashable:
        """The function's code and what it captures, read now: an in-place edit of a captured
        tensor (its version) or a rebound closure cell makes another key."""
        return ("function", _captured(self.fn), self.batch, self.heads)

    def tensors(self) -> list[torch.Tensor]:
        return list(self._tensors)

    def compile_fields(self) -> dict[str, object]:
        return {"token": self.token, "batch": self.batch, "heads": self.heads}

    @classmethod
    def from_fields(cls: type[_Spec], fields: Mapping[str, object]) -> _Spec:
        token = str(fields["token"])
        fn = _FUNCTIONS.get(token, _STRONG.get(token))
        if fn is None:
            raise RuntimeError(f"attnkit: the mask function {token} is no longer alive")
        spec = cls.__new__(cls)
        spec.__dict__.update(fields, fn=fn)
        spec._derive()
        return spec

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return self.call(b, h, q, kv)

    def call(
        self, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        """``fn(b, h, q, kv)`` on int32 indices, checked: a bool tensor that broadcasts to the
        indices' shape."""
        b, h, q, kv = (t if t.dtype == torch.int32 else t.to(torch.int32) for t in (b, h, q, kv))
        try:
            out = self.fn(b, h, q, kv)
        except AttentionInputError:
            raise
        except Exception as e:  # the user's function failed: say where, keep the cause
            self._refuse(
                f"the mask function `fn` raised {type(e).__name__}: {e}",
                got=f"{self!r} called with {_shapes(b, h, q, kv)}",
                expected="fn(b, h, q_idx, kv_idx) -> bool tensor, for any broadcastable "
                "integer index tensors",
                fix="make fn work on index tensors (torch ops, no Python branching on them)",
                cause=e,
            )
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            got = type(out).__name__
            if isinstance(out, torch.Tensor):
                got = f"tensor {tuple(out.shape)} dtype={out.dtype}"
            self._refuse(
                "`fn` must return a bool tensor (True = may attend).",
                got=f"{self!r} returned {got}",
                expected="a torch.bool tensor",
                fix="return a comparison (kv_idx <= q_idx), or `x != 0` for a 0/1 tensor",
            )
        target = _broadcast((b.shape, h.shape, q.shape, kv.shape))
        if not _broadcasts(tuple(out.shape), target):
            self._refuse(
                "the result of `fn` does not broadcast to the (b, h, q, kv) shape it was "
                "called with.",
                got=f"{self!r} returned {tuple(out.shape)} for {_shapes(b, h, q, kv)}",
                expected=f"a bool tensor that broadcasts to {target}",
                fix="compute elementwise from the index tensors (no reductions, no reshapes)",
            )
        return out

    def _refuse(
        self, problem: str, *, got: str, expected: str, fix: str, cause: Exception | None = None
    ) -> None:
        err = AttentionInputError(
            "attnkit.masks.from_function", "fn", problem, got=got, expected=expected, fix=fix
        )
        raise err from cause

    def key_runs(self, pos: torch.Tensor, off: int) -> Spans | None:
        """Each row's allowed keys as one run, found by evaluating the function on every pair
        of the rows and the keys :func:`key_extent` names (a group of rows at a time:
        :func:`~attnkit.masks.function_runs.function_runs`); ``None`` where a row's keys are
        not one run, the function reads the head, or no extent is set. Rows that see nothing
        get ``lo > hi``."""
        extent = _KEYS.get()
        if extent is None or self.heads is not None:
            return None
        dev = self.device or torch.device("cpu")
        return function_runs(self.call, pos, extent, self.batch or 1, dev)

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        dev = q_lo.device
        qs, ks = q_lo.view(-1).tolist(), q_hi.view(-1).tolist()
        kl, kh = k_lo.view(-1).tolist(), k_hi.view(-1).tolist()
        key = (self.key(), tuple(qs), tuple(ks), tuple(kl), tuple(kh), str(dev))
        if key in _BOUNDS:
            _STATS["hits"] += 1
            _BOUNDS.move_to_end(key)
            return _BOUNDS[key][1:]
        _STATS["misses"] += 1
        any_, all_ = self._classify(qs, ks, kl, kh, dev)
        _BOUNDS[key] = (self, any_, all_)  # held with the spec: its ids are not reused
        while len(_BOUNDS) > _BOUNDS_SIZE:
            _BOUNDS.popitem(last=False)
        return any_, all_

    def _classify(
        self, qs: list[int], qe: list[int], kl: list[int], kh: list[int], dev: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(any, all)`` ``(B', H', nq, nk)`` from evaluating the function on every pair of
        every block: a group of equal, consecutive block rows against a run of keys at a time
        (at most :data:`CHUNK_PAIRS` pairs per call). A block above :data:`CHUNK_PAIRS` pairs
        (``allows_all`` asks about one block of ``L x S``) is answered "partial" without
        evaluating it: a yes/no question is not worth ``L x S`` evaluations."""
        Bm, Hm = self.batch or 1, self.heads or 1
        shape = (Bm, Hm, len(qs), len(kl))
        if (
            max(e - s + 1 for s, e in zip(qs, qe, strict=True))
            * max(e - s + 1 for s, e in zip(kl, kh, strict=True))
            > CHUNK_PAIRS
        ):
            yes = torch.ones(shape, dtype=torch.bool, device=dev)
            return yes, ~yes
        k0, k1 = min(kl), max(kh) + 1
        lo = torch.tensor(kl, device=dev) - k0  # (nk,) into the prefix sums
        hi = torch.tensor(kh, device=dev) - k0 + 1
        width = (hi - lo).view(1, 1, 1, -1)
        b = torch.arange(Bm, device=dev).view(Bm, 1, 1, 1)
        h = torch.arange(Hm, device=dev).view(1, Hm, 1, 1)
        counts: list[torch.Tensor] = []  # allowed pairs per block, (B', H', n, nk) per group
        areas: list[torch.Tensor] = []
        i, nq = 0, len(qs)
        while i < nq:
            rows = qe[i] - qs[i] + 1
            n = max(1, CHUNK_PAIRS // max(rows * (k1 - k0) * Bm * Hm, 1))
            j = i + 1
            while j < min(nq, i + n) and qs[j] == qe[j - 1] + 1 and qe[j] - qs[j] + 1 == rows:
                j += 1
            q = torch.arange(qs[i], qe[j - 1] + 1, device=dev).view(1, 1, -1, 1)
            sums = self._row_sums(b, h, q, (k0, k1), (Bm, Hm, j - i, rows))
            counts.append(sums[..., hi] - sums[..., lo])
            areas.append(width.expand(1, 1, j - i, -1) * rows)
            i = j
        count, area = torch.cat(counts, dim=2), torch.cat(areas, dim=2)
        return count > 0, count == area

    def _row_sums(
        self,
        b: torch.Tensor,
        h: torch.Tensor,
        q: torch.Tensor,
        keys: tuple[int, int],
        dims: tuple[int, int, int, int],
    ) -> torch.Tensor:
        """Prefix sums over keys ``(B', H', n, span + 1)`` int32 of the allowed pairs of ``n``
        block rows of ``rows`` queries each, a run of keys at a time."""
        Bm, Hm, n, rows = dims
        step = max(1, CHUNK_PAIRS // (Bm * Hm * n * rows))
        parts = [torch.zeros(Bm, Hm, n, 1, dtype=torch.int32, device=q.device)]
        for a in range(keys[0], keys[1], step):
            z = min(a + step, keys[1])
            kv = torch.arange(a, z, device=q.device).view(1, 1, 1, z - a)
            ok = self.call(b, h, q, kv).expand(Bm, Hm, n * rows, z - a)
            per_row = ok.reshape(Bm, Hm, n, rows, z - a).sum(3, dtype=torch.int32)
            parts.append(per_row.cumsum(-1, dtype=torch.int32) + parts[-1][..., -1:])
        return torch.cat(parts, dim=-1)

    def __repr__(self) -> str:
        extra = "".join(
            f", {n}={v}" for n, v in (("batch", self.batch), ("heads", self.heads)) if v
        )
        return f"from_function({_name(self.fn)}{extra})"


def _shapes(*ts: torch.Tensor) -> str:
    return ", ".join(
        f"{n} {tuple(t.shape)}" for n, t in zip(("b", "h", "q_idx", "kv_idx"), ts, strict=True)
    )


def _broadcast(shapes: tuple[torch.Size, ...]) -> tuple[int, ...]:
    """The broadcast shape of index tensors (without :func:`torch.broadcast_shapes`, whose
    first call imports sympy: seconds)."""
    dims = max(len(s) for s in shapes)
    padded = [(1,) * (dims - len(s)) + tuple(s) for s in shapes]
    return tuple(max(col) for col in zip(*padded, strict=True))


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    if len(shape) > len(target):
        return False
    return all(a in (1, t) for a, t in zip(shape[::-1], target[::-1], strict=False))


def _probe(spec: FunctionMask) -> None:
    """Call the function once on a few pairs: a function that fails, returns no bool tensor,
    or reads ``b`` / ``h`` though no ``batch`` / ``heads`` was declared, is refused here."""
    dev = spec.device
    one = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
    two = torch.arange(2, device=dev)
    spec.call(one, one, one, one)  # refuses a failing or ill-typed function
    for dim, declared, name in ((0, spec.batch, "batch"), (1, spec.heads, "heads")):
        if declared is not None:
            continue
        shape = [1, 1, 1, 1]
        shape[dim] = 2
        idx = [one, one]
        idx[dim] = two.view(shape)
        try:
            out = spec.fn(idx[0], idx[1], one, one)
        except Exception:  # an index table of one row: the function cannot vary with it
            continue
        if isinstance(out, torch.Tensor) and out.dim() == 4 and out.shape[dim] == 2:
            letter = "b" if dim == 0 else "h"
            spec_error(
                "from_function",
                name,
                f"the mask function depends on `{letter}` but no `{name}` was given: attnkit "
                f"would evaluate it at {letter} = 0 only.",
                got=f"{spec!r}: fn(...) has a {name} dimension",
                expected=f"from_function(fn, {name}=N), N the call's {name} size",
                fix=f"from_function(fn, {name}={'B' if dim == 0 else 'H'})",
            )


def from_function(
    fn: MaskFunction, *, batch: int | None = None, heads: int | None = None
) -> MaskSpec:
    """A mask spec from ``fn(b, h, q_idx, kv_idx) -> bool tensor`` (True = may attend).

    ``fn`` is flex_attention's ``mask_mod`` (and transformers' mask functions): it is called
    with broadcastable integer index tensors and must compute elementwise. ``q_idx`` is the
    raw query row (flex's convention): attnkit's end-aligned causal rule for ``L != S`` is
    ``kv_idx <= q_idx + S - L``. A function that reads ``b`` (``h``) needs ``batch=B``
    (``heads=H``): blocks are then classified per batch row (head); without them it is
    evaluated at ``b = h = 0``, and a function that varies with them is refused.

    >>> spec = from_function(lambda b, h, q, kv: (kv <= q) & (q - kv < 3))
    >>> print(spec)
    from_function(<lambda>), drawn for L = S = 8 (1 = may attend):
    1 . . . . . . .
    1 1 . . . . . .
    1 1 1 . . . . .
    . 1 1 1 . . . .
    . . 1 1 1 . . .
    . . . 1 1 1 . .
    . . . . 1 1 1 .
    . . . . . 1 1 1
    """
    if not callable(fn):
        spec_error(
            "from_function",
            "fn",
            "`fn` must be a callable fn(b, h, q_idx, kv_idx) -> bool tensor.",
            got=f"fn: {type(fn).__name__}",
            expected="a function of four index tensors returning a bool tensor",
            fix="from_function(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx)",
        )
    if torch.compiler.is_compiling():  # Dynamo cannot trace the probe and the token
        spec_error(
            "from_function",
            "fn",
            "a function mask cannot be built inside a function torch.compile traces.",
            got="from_function(...) called while torch.compile traces",
            expected="the spec built outside the compiled function",
            fix="build it once outside and close over it (or pass it in); a compiled call "
            "then runs it",
        )
    for name, n in (("batch", batch), ("heads", heads)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            spec_error(
                "from_function",
                name,
                f"`{name}` must be a positive int or None.",
                got=f"{name}={n!r}",
                expected=f"{name} >= 1, the call's {name} size (None: fn ignores it)",
                fix=f"from_function(fn, {name}=q.shape[{0 if name == 'batch' else 1}])",
            )
    spec = FunctionMask(fn, batch, heads)
    _probe(spec)
    return spec
