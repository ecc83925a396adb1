"""Write the attention maps of one sequence to disk: NPZ (data), PNG (all heads), HTML (explorer).

Dimension legend: N layers, H heads, T tokens (every map is T x T: rows are query tokens, columns
are key tokens), E hidden width.

The writers take plain arrays, so they work for any model: ``attentions (N, H, T, T)`` holds
softmax weights (each row sums to 1), ``tokens`` the T token strings, ``hidden (T, E)`` the last
hidden states. numpy arrays and torch tensors are both accepted. matplotlib is imported only when a
PNG is written.
Each file is written by :mod:`attnkit.files`: to a temporary file next to it, then moved into
place, so a failed write leaves the previous file intact and a symbolic link at its name is
replaced, never written through.

>>> import tempfile
>>> import numpy as np
>>> attentions = np.full((2, 3, 4, 4), 0.25, dtype=np.float32)  # (N=2, H=3, T=4, T=4)
>>> with tempfile.TemporaryDirectory() as out:
...     paths = write_all(out, attentions, ["[CLS]", "hi", "there", "[SEP]"], np.zeros((4, 8)))
...     sorted(p.name for p in paths.values())
['attention.html', 'attention.npz', 'attention.png']
"""

from __future__ import annotations

import base64
import errno
import html
import json
import math
import os
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from attnkit import files
from attnkit.errors import AttentionInputError, shape_str

__all__ = ["write_all", "write_html", "write_npz", "write_png"]

Array: TypeAlias = "npt.NDArray[Any] | torch.Tensor"
Float32: TypeAlias = "npt.NDArray[np.float32]"

ATTENTION_DIMS = ("N", "H", "T", "T")
HIDDEN_DIMS = ("T", "E")
FILES = {"html": "attention.html", "png": "attention.png", "npz": "attention.npz"}
# the HTML page, package data: inline CSS and vanilla JS; _page fills in __TITLE__ (twice),
# __SUBTITLE__ and __DATA__ (the maps as JSON in a <script> block, the weights as codes: see
# _quantise), all in one pass
TEMPLATE = ("templates", "attention.html")
PLACEHOLDER = re.compile(r"__([A-Z]+)__")
SURROGATE = re.compile(r"[\ud800-\udfff]")  # a lone one: from undecodable bytes (surrogateescape)
HTML_16BIT_MAX = 1 << 21  # up to this many weights N*H*T*T the HTML keeps 16-bit codes, then 8-bit
PNG_DPI = 90
PNG_MAP_IN = 1.0  # inches per heatmap in the PNG grid
PNG_GAP_IN = (0.12, 0.24)  # between heatmaps: (across, down; room for the "L0 H0" titles)
WEIGHT_SLACK = 1e-3  # float16/bfloat16 softmax can overshoot [0, 1] by a rounding step


# ---------------------------------------------------------------------------------------------
# input checks


def _to_float32(where: str, name: str, x: object) -> Float32:
    if isinstance(x, torch.Tensor):
        return np.ascontiguousarray(x.detach().cpu().float().numpy())
    if isinstance(x, np.ndarray):
        if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
            raise AttentionInputError(
                where,
                name,
                f"`{name}` has dtype {x.dtype}; it must hold numbers.",
                got=f"{name}.dtype = {x.dtype}",
                expected="a floating-point array",
            )
        return np.ascontiguousarray(x, dtype=np.float32)
    raise AttentionInputError(
        where,
        name,
        f"`{name}` is a {type(x).__name__}, not an array.",
        got=f"{name}: {type(x).__name__}",
        expected="a numpy array or a torch tensor",
        fix=f"convert it first, e.g. np.asarray({name}, dtype=np.float32)",
    )


def _check_tokens(where: str, tokens: object) -> list[str]:
    if isinstance(tokens, str) or not isinstance(tokens, Sequence | np.ndarray):
        raise AttentionInputError(
            where,
            "tokens",
            f"`tokens` is a {type(tokens).__name__}; it must be a sequence of token strings.",
            got=f"tokens: {type(tokens).__name__}",
            expected="a list of T strings, one per position",
            fix="split the text with the model's tokenizer, e.g. tokenizer.encode(text).tokens",
        )
    bad = [(i, t) for i, t in enumerate(tokens) if not isinstance(t, str)]
    if bad:
        i, t = bad[0]
        raise AttentionInputError(
            where,
            "tokens",
            f"`tokens[{i}]` is a {type(t).__name__}, not a string.",
            got=f"tokens[{i}] = {t!r}",
            expected="every token a str",
            fix="pass token strings, not token ids (tokenizer.convert_ids_to_tokens)",
        )
    return [str(t) for t in tokens]


def _check_attentions(where: str, attentions: object, tokens: object) -> tuple[Float32, list[str]]:
    att = _to_float32(where, "attentions", attentions)
    toks = _check_tokens(where, tokens)
    got = shape_str("attentions", att.shape, ATTENTION_DIMS)
    if att.ndim != 4:
        raise AttentionInputError(
            where,
            "attentions",
            f"`attentions` is {att.ndim}-D; it must be 4-D (layers, heads, query, key).",
            got=got,
            expected="attentions as (N, H, T, T) for one sequence",
            fix="for a batch, pick one sequence, e.g. attentions[:, 0]"
            if att.ndim == 5
            else "stack the per-layer maps: torch.stack([a[0] for a in per_layer])",
        )
    N, H, L, S = att.shape
    if min(N, H, L) == 0 or L != S:
        raise AttentionInputError(
            where,
            "attentions",
            "the maps must be square self-attention maps with at least one layer, head and token.",
            got=got,
            expected="attentions as (N, H, T, T) with N, H, T >= 1",
        )
    if len(toks) != L:
        raise AttentionInputError(
            where,
            "tokens",
            f"`attentions` has maps for T={L} tokens, but {len(toks)} tokens were given.",
            got=f"{got}  tokens (len={len(toks)})",
            expected="len(tokens) == T",
            fix="pass the tokens of the same sequence, special tokens ([CLS], [SEP]) included",
        )
    finite = np.isfinite(att)
    if not finite.all():
        first = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise AttentionInputError(
            where,
            "attentions",
            f"`attentions` holds NaN or inf, first at {first}.",
            got=got,
            expected="finite softmax weights",
            fix="a fully masked row is NaN after a plain softmax; attnkit.attention gives 0 there",
        )
    lo, hi = float(att.min()), float(att.max())
    if lo < -WEIGHT_SLACK or hi > 1 + WEIGHT_SLACK:
        raise AttentionInputError(
            where,
            "attentions",
            f"`attentions` has values in [{lo:.4g}, {hi:.4g}]; weights lie in [0, 1].",
            got=got,
            expected="softmax probabilities (each row sums to 1)",
            fix="pass the weights after softmax, not the raw scores q @ k^T",
        )
    return att, toks


def _check_hidden(where: str, hidden: object, T: int) -> Float32:
    hid = _to_float32(where, "hidden", hidden)
    if hid.ndim != 2 or hid.shape[0] != T:
        raise AttentionInputError(
            where,
            "hidden",
            f"`hidden` must be (T, E) with T={T}, one row per token.",
            got=shape_str("hidden", hid.shape, HIDDEN_DIMS),
            expected=f"hidden as (T={T}, E)",
            fix="for a batch, pick one sequence, e.g. hidden[0]" if hid.ndim == 3 else None,
        )
    return hid


@contextmanager
def _writing(where: str, argument: str, path: Path) -> Iterator[None]:
    """Turn an OSError while writing ``path`` into an AttentionInputError naming ``argument``."""
    try:
        yield
    except files.WriteError as e:  # a file could not be replaced: said by this writer
        raise e.at(where, argument) from e.__cause__
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):  # a full disk reads as every writer says it
            raise files.os_error(e, path, where=where, argument=argument, existed=False) from e
        raise AttentionInputError(
            where,
            argument,
            f"cannot write `{path}`: {e.strerror or e}.",
            got=f"{argument} = {str(path)!r}",
            expected="a directory that exists or can be created, and that is writable",
            fix="choose another output directory",
        ) from e


def _write_file(where: str, path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Create the parent directory of ``path``, then ``write(path)``; OSError names ``path``."""
    out = Path(path)
    with _writing(where, "path", out):
        files.make_directory(out.parent, where=where, argument="path")
        write(out)
    return out


# ---------------------------------------------------------------------------------------------
# the three formats, on checked arrays


def _npz(path: Path, att: Float32, toks: list[str], hid: Float32) -> None:
    tokens = np.array(toks, dtype=np.str_)  # fixed-width unicode: loads with allow_pickle=False
    # a file object, so numpy does not append ".npz" to the name
    with files.replacing(path) as tmp, tmp.open("wb") as f:
        np.savez_compressed(f, attentions=att, tokens=tokens, hidden=hid)


def _short(token: str, width: int = 12) -> str:
    return token if len(token) <= width else token[: width - 1] + "…"


def _png(path: Path, att: Float32, toks: list[str], title: str | None) -> None:
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import PowerNorm
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    N, H, T, _ = att.shape
    # One Axes spans the whole figure and every heatmap is an image placed in it: 72 separate
    # Axes with tick labels take seconds to build and draw, this takes a fraction of one.
    # Layout in inches; data units are token cells, `u` of them per inch.
    room_pt = PNG_MAP_IN * 72 * 0.9  # token labels: a font that fits T of them along one map,
    font = min(7.0, max(4.0, room_pt / T))  # and every k-th only when even 4 pt would overlap
    every = 1 if room_pt / T >= 4.0 else math.ceil(T * 4.0 / room_pt)
    labels = [_short(t) if i % every == 0 else "" for i, t in enumerate(toks)]
    label_in = 0.1 + max(len(s) for s in labels) * font * 0.62 / 72
    left, right, top, bottom = label_in + 0.3, 0.9, 0.8, label_in + 0.3
    step_x, step_y = PNG_MAP_IN + PNG_GAP_IN[0], PNG_MAP_IN + PNG_GAP_IN[1]
    width = left + H * step_x - PNG_GAP_IN[0] + right
    height = top + N * step_y - PNG_GAP_IN[1] + bottom
    u = T / PNG_MAP_IN

    fig = Figure(figsize=(width, height), dpi=PNG_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_axis_off()
    ax.set_xlim(-left * u, (width - left) * u)
    ax.set_ylim((height - top) * u, -top * u)  # y grows downwards, like the rows of a map
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)  # sqrt scale: weak weights stay visible
    cmap = colormaps["Blues"]
    smooth = T > PNG_MAP_IN * PNG_DPI  # more tokens than pixels: average instead of dropping
    for layer in range(N):
        for head in range(H):
            x0, y0 = head * step_x * u, layer * step_y * u  # top-left corner of this map
            ax.imshow(
                att[layer, head],
                cmap=cmap,
                norm=norm,
                extent=(x0, x0 + T, y0 + T, y0),
                interpolation="antialiased" if smooth else "nearest",
            )
            ax.add_patch(Rectangle((x0, y0), T, T, fill=False, lw=0.5, ec="#9aa4ae"))
            ax.text(
                x0 + T / 2, y0 - 0.04 * u, f"L{layer} H{head}", ha="center", va="bottom", fontsize=7
            )
    last_row = (N - 1) * step_y * u + T
    style = {"fontsize": font, "parse_math": False}  # a token like "$x$" is text, not TeX
    for i, label in enumerate(labels):
        for layer in range(N if label else 0):
            y = layer * step_y * u + i + 0.5
            ax.text(-0.05 * u, y, label, ha="right", va="center", **style)
        for head in range(H if label else 0):
            x = head * step_x * u + i + 0.5
            ax.text(x, last_row + 0.05 * u, label, ha="center", va="top", rotation=90, **style)
    fig.text(0.5, 0.12 / height, "key token", ha="center", va="bottom", fontsize=8)
    fig.text(0.1 / width, 0.5, "query token", ha="left", va="center", rotation=90, fontsize=8)
    heading = title if title is not None else "attention maps"
    fig.suptitle(
        f"{heading}\n{N} layers × {H} heads, T={T}   rows: query, columns: key   colour: √weight",
        fontsize=9,
        y=1 - 0.08 / height,
        va="top",
        parse_math=False,
    )
    grid_h = N * step_y - PNG_GAP_IN[1]
    bar = fig.add_axes(
        (
            1 - (right - 0.25) / width,
            (bottom + grid_h * 0.2) / height,
            0.12 / width,
            grid_h * 0.6 / height,
        )
    )
    fig.colorbar(ScalarMappable(norm, cmap), cax=bar, ticks=[0, 0.05, 0.25, 0.5, 1], format="%g")
    bar.tick_params(labelsize=6)
    with files.replacing(path) as tmp:
        fig.savefig(tmp, format="png")


def _quantise(att: Float32) -> tuple[int, npt.NDArray[np.float64], bytes]:
    """Each (layer, head) map as integer codes, zlib-deflated: ``(bits, scales (N, H), codes)``.

    A weight is read back as ``code * step``, ``step = scale / (2**bits - 1)`` with ``scale`` the
    map's largest weight: within ``step / 2`` of ``att``. The codes are (N, H, T, T) in C order,
    little-endian; negative rounding noise (see WEIGHT_SLACK) is stored as 0.
    """
    bits = 16 if att.size <= HTML_16BIT_MAX else 8
    top = 2**bits - 1
    scales = att.max(axis=(2, 3)).clip(min=0).astype(np.float64)  # (N, H)
    steps = np.where(scales > 0, scales / top, 1.0)  # an all-zero map has only 0 codes
    dtype = np.dtype(np.uint8) if bits == 8 else np.dtype("<u2")
    deflate = zlib.compressobj()
    parts = []
    for layer, step in zip(att, steps, strict=True):  # (H, T, T), (H,): the float64 copy is small
        codes = np.rint(layer.clip(min=0) / step[:, None, None]).clip(max=top)
        parts.append(deflate.compress(codes.astype(dtype).tobytes()))
    parts.append(deflate.flush())
    return bits, scales, b"".join(parts)


def _fill(template: str, values: dict[str, str]) -> str:
    """``template`` with each ``__NAME__`` replaced by ``values[NAME]``, in one pass over the
    template: a value is never searched for placeholders, so no text in it can become one."""
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def _page(att: Float32, toks: list[str], title: str | None) -> str:
    """The HTML page of the maps: the title HTML-escaped, the data JSON that cannot end its
    ``<script>`` block, both filled into the template in one pass (:func:`_fill`)."""
    N, H, T, _ = att.shape
    bits, scales, codes = _quantise(att)
    payload = {
        "tokens": toks,
        "layers": N,
        "heads": H,
        "bits": bits,
        "scales": scales.tolist(),
        "codes": base64.b64encode(codes).decode("ascii"),
    }
    # ASCII JSON: a lone surrogate, U+2028 and U+2029 are escapes too. Inside <script> only
    # "</script" or "<!--" could end or bend the data block; escaping every <, >, & is simpler
    data = json.dumps(payload, ensure_ascii=True, separators=(",", ":"))
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    heading = SURROGATE.sub("\ufffd", title if title is not None else "attention maps")
    folder, name = TEMPLATE
    template = resources.files("attnkit.inspect").joinpath(folder).joinpath(name)
    return _fill(
        template.read_text(encoding="utf-8"),
        {
            "TITLE": html.escape(heading),
            "SUBTITLE": f"{N} layers × {H} heads, {T} tokens",
            "DATA": data,
        },
    )


def _html(path: Path, att: Float32, toks: list[str], title: str | None) -> None:
    files.write_text(path, _page(att, toks, title))


# ---------------------------------------------------------------------------------------------
# public writers


def write_npz(
    path: str | os.PathLike[str], attentions: Array, tokens: Sequence[str], hidden: Array
) -> Path:
    """Save the maps as an ``.npz`` that loads with ``np.load(path, allow_pickle=False)``.

    Arrays in the file: ``attentions`` float32 (N, H, T, T), ``tokens`` unicode (T,), ``hidden``
    float32 (T, E). Raises :class:`~attnkit.AttentionInputError` for bad shapes or an unwritable
    path.

    >>> import tempfile
    >>> import numpy as np
    >>> with tempfile.TemporaryDirectory() as out:
    ...     att, hidden = np.eye(2).reshape(1, 1, 2, 2), np.ones((2, 3))  # (N, H, T, T), (T, E)
    ...     p = write_npz(f"{out}/a.npz", att, ["a", "b"], hidden)
    ...     np.load(p, allow_pickle=False)["tokens"].tolist()
    ['a', 'b']
    """
    where = "attnkit.inspect.write_npz"
    att, toks = _check_attentions(where, attentions, tokens)
    hid = _check_hidden(where, hidden, len(toks))
    return _write_file(where, path, lambda out: _npz(out, att, toks, hid))


def write_png(
    path: str | os.PathLike[str],
    attentions: Array,
    tokens: Sequence[str],
    *,
    title: str | None = None,
) -> Path:
    """Draw every head of every layer as one grid of heatmaps: N rows (layers) x H columns (heads).

    Each heatmap is ``attentions[layer, head]`` (T, T), query tokens down, key tokens across, on
    one sqrt colour scale from 0 to 1 so heads can be compared. Token labels sit on the first
    column and the last row. Drawn with matplotlib's Agg canvas; pyplot and the user's backend are
    left alone.

    >>> import tempfile
    >>> import numpy as np
    >>> with tempfile.TemporaryDirectory() as out:
    ...     write_png(f"{out}/a.png", np.eye(2).reshape(1, 1, 2, 2), ["a", "b"]).stat().st_size > 0
    True
    """
    where = "attnkit.inspect.write_png"
    att, toks = _check_attentions(where, attentions, tokens)
    return _write_file(where, path, lambda out: _png(out, att, toks, title))


def write_html(
    path: str | os.PathLike[str],
    attentions: Array,
    tokens: Sequence[str],
    *,
    title: str | None = None,
) -> Path:
    """Write one self-contained HTML page to explore the maps; it needs no network or server.

    The page shows one (T, T) heatmap (query rows, key columns) chosen with the ``#layer`` and
    ``#head`` selects (``head`` also offers ``avg``, the mean over the layer's heads), a readout of
    query token, key token and weight for the cell under the mouse, and thumbnails of all N x H maps
    that select on click. The maps are drawn on canvases.

    Each map is stored compactly: its weights as integer codes scaled to the map's largest weight,
    deflated and base64-encoded. The codes are 16-bit up to 2**21 weights in all (6 x 12 maps of
    170 tokens), 8-bit beyond; the readout shows a weight as ``≈ w ± e``, ``e`` half a code step.
    The size depends on how well the maps compress, at most about 4/3 byte a weight beyond 2**21:
    all-MiniLM-L6-v2's 6 x 12 maps of a 512-token text take about 5 MB. The page inflates the
    codes with the browser's ``DecompressionStream`` (every major browser since 2023).

    >>> import tempfile
    >>> import numpy as np
    >>> with tempfile.TemporaryDirectory() as out:
    ...     page = write_html(f"{out}/a.html", np.eye(2).reshape(1, 1, 2, 2), ["<s>", "b"])
    ...     "<s>" in page.read_text()
    False
    """
    where = "attnkit.inspect.write_html"
    att, toks = _check_attentions(where, attentions, tokens)
    return _write_file(where, path, lambda out: _html(out, att, toks, title))


def write_all(
    out_dir: str | os.PathLike[str],
    attentions: Array,
    tokens: Sequence[str],
    hidden: Array,
    *,
    title: str | None = None,
) -> dict[str, Path]:
    """Write ``attention.html``, ``attention.png`` and ``attention.npz`` into ``out_dir``.

    ``attentions (N, H, T, T)``, ``tokens`` (T strings), ``hidden (T, E)``; see the writers for
    each format. All inputs are checked before anything is written; ``out_dir`` is created when
    missing. Returns the paths by format: ``{"html": ..., "png": ..., "npz": ...}``. Raises
    :class:`~attnkit.AttentionInputError` (argument ``out``) when ``out_dir`` cannot be written.

    >>> import tempfile
    >>> import numpy as np
    >>> with tempfile.TemporaryDirectory() as out:
    ...     sorted(write_all(out, np.eye(2).reshape(1, 1, 2, 2), ["a", "b"], np.ones((2, 3))))
    ['html', 'npz', 'png']
    """
    where = "attnkit.inspect.write_all"
    att, toks = _check_attentions(where, attentions, tokens)
    hid = _check_hidden(where, hidden, len(toks))
    directory = Path(out_dir)
    paths = {kind: directory / name for kind, name in FILES.items()}
    with _writing(where, "out", directory):
        files.make_directory(directory, where=where, argument="out")
        _npz(paths["npz"], att, toks, hid)  # the cheap writes first: a bad directory fails fast
        _html(paths["html"], att, toks, title)
        _png(paths["png"], att, toks, title)
    return paths
