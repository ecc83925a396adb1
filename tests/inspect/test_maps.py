"""The attention-map writers: NPZ round trip, PNG content, a self-contained HTML page, input checks.

Dimension legend: N layers, H heads, T tokens, E hidden width.
"""

from __future__ import annotations

import base64
import html
import json
import re
import subprocess
import sys
import zlib
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from attnkit import AttentionInputError
from attnkit.inspect import maps as maps_module
from attnkit.inspect import write_all, write_html, write_npz, write_png

mpimg = pytest.importorskip(
    "matplotlib.image",
    reason="matplotlib is not installed (the inspect extra: pip install '.[inspect]')",
)

TOKENS = ["[CLS]", "the", "<b>&", "cat", '"sat"', "on", "</script>", "mat", "[SEP]", "$x$"]


def softmax_maps(N: int, H: int, T: int, seed: int = 0) -> np.ndarray:
    """(N, H, T, T) float32 rows that sum to 1, some sharp and some flat, like a real model's."""
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(N, H, T, T)) * rng.uniform(0.5, 5.0, size=(N, H, 1, 1))
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    maps: np.ndarray = (weights / weights.sum(-1, keepdims=True)).astype(np.float32)
    return maps


@pytest.fixture(scope="module")
def minilm_sized(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], np.ndarray]:
    """write_all on MiniLM's shape: 6 layers x 12 heads, T=10, width 384."""
    att = softmax_maps(6, 12, len(TOKENS))
    hidden = np.random.default_rng(1).normal(size=(len(TOKENS), 384)).astype(np.float32)
    out = tmp_path_factory.mktemp("maps") / "new" / "dir"  # created by write_all
    return write_all(out, att, TOKENS, hidden, title="MiniLM <test> & co"), att


def embedded_data(page: str) -> dict[str, Any]:
    match = re.search(r'<script type="application/json" id="attn-data">(.*?)</script>', page, re.S)
    assert match is not None, "the page has no JSON data block"
    data: dict[str, Any] = json.loads(match.group(1))
    return data


def decoded(data: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The page's decode() and matrix() in numpy: weights (N, H, T, T) and code steps (N, H).

    base64, then zlib inflate, then 8- or 16-bit little-endian codes; weight = code * step with
    step = scale / (2**bits - 1), the same float64 operations as the page's JavaScript.
    """
    bits = data["bits"]
    codes = np.frombuffer(
        zlib.decompress(base64.b64decode(data["codes"])), dtype=np.uint8 if bits == 8 else "<u2"
    )
    steps = np.array(data["scales"], dtype=np.float64) / (2**bits - 1)
    N, H, T = data["layers"], data["heads"], len(data["tokens"])
    return codes.reshape(N, H, T, T) * steps[:, :, None, None], steps


# ---------------------------------------------------------------------------------------------
# NPZ


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_npz_round_trip(tmp_path: Path, kind: str) -> None:
    att = softmax_maps(2, 3, 5)
    hidden = np.random.default_rng(2).normal(size=(5, 8))  # float64 in, float32 out
    tokens = ["[CLS]", "é", "<b>&", "", "[SEP]"]
    att_in: np.ndarray | torch.Tensor = att
    hidden_in: np.ndarray | torch.Tensor = hidden
    if kind == "torch":
        att_in = torch.tensor(att, requires_grad=True)
        hidden_in = torch.tensor(hidden, dtype=torch.float64)
    path = write_npz(tmp_path / "attention.npz", att_in, tokens, hidden_in)
    with np.load(path, allow_pickle=False) as f:
        assert sorted(f.files) == ["attentions", "hidden", "tokens"]
        assert f["attentions"].dtype == np.float32
        assert f["attentions"].shape == (2, 3, 5, 5)
        assert f["hidden"].dtype == np.float32
        assert f["hidden"].shape == (5, 8)
        assert f["tokens"].dtype.kind == "U"
        assert f["tokens"].tolist() == tokens
        np.testing.assert_array_equal(f["attentions"], att)
        np.testing.assert_array_equal(f["hidden"], hidden.astype(np.float32))


def test_npz_is_written_under_the_exact_name(tmp_path: Path) -> None:
    path = write_npz(tmp_path / "maps.data", softmax_maps(1, 1, 2), ["a", "b"], np.zeros((2, 3)))
    assert path == tmp_path / "maps.data"
    assert [p.name for p in tmp_path.iterdir()] == ["maps.data"]  # numpy did not add ".npz"


def test_write_all_files(minilm_sized: tuple[dict[str, Path], np.ndarray]) -> None:
    paths, att = minilm_sized
    assert {k: p.name for k, p in paths.items()} == {
        "html": "attention.html",
        "png": "attention.png",
        "npz": "attention.npz",
    }
    with np.load(paths["npz"], allow_pickle=False) as f:
        np.testing.assert_array_equal(f["attentions"], att)
        assert f["tokens"].tolist() == TOKENS


# ---------------------------------------------------------------------------------------------
# PNG


def test_png_is_a_matplotlib_grid(minilm_sized: tuple[dict[str, Path], np.ndarray]) -> None:
    paths, _ = minilm_sized
    raw = paths["png"].read_bytes()
    assert raw.startswith(b"\x89PNG\r\n\x1a\n")
    assert b"Matplotlib" in raw  # the Software tEXt chunk that matplotlib writes
    image = mpimg.imread(paths["png"])
    height, width, channels = image.shape
    assert channels in (3, 4)
    assert 900 < width < 2000, image.shape  # 12 heads across
    assert 500 < height < 1200, image.shape  # 6 layers down
    assert width > height
    rgb = image[..., :3]
    assert rgb.std() > 0.05, "the image is blank"
    dark_blue = (rgb[..., 2] > 0.3) & (rgb[..., 0] < 0.15)  # high weights in the Blues colormap
    assert dark_blue.mean() > 0.001


def test_png_accepts_torch_and_a_single_map(tmp_path: Path) -> None:
    att = torch.tensor(softmax_maps(1, 1, 3))
    path = write_png(tmp_path / "one.png", att, ["a", "$b$", "c"], title="$not tex$")
    assert mpimg.imread(path).shape[2] in (3, 4)


def test_import_does_not_load_matplotlib() -> None:
    code = "import sys, attnkit.inspect; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------
# HTML


def test_html_is_self_contained(minilm_sized: tuple[dict[str, Path], np.ndarray]) -> None:
    paths, _ = minilm_sized
    page = paths["html"].read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, re.I)
    assert not re.search(r"<link\b", page, re.I)
    assert not re.search(r"@import|url\(|https?://", page, re.I)
    for stable_id in ('id="layer"', 'id="head"', 'id="readout"', 'id="heatmap"', 'id="overview"'):
        assert stable_id in page


def test_html_embeds_the_weights(minilm_sized: tuple[dict[str, Path], np.ndarray]) -> None:
    paths, att = minilm_sized
    data = embedded_data(paths["html"].read_text(encoding="utf-8"))
    assert (data["layers"], data["heads"], data["tokens"]) == (6, 12, TOKENS)
    assert data["bits"] == 16  # 7,200 weights
    weights, steps = decoded(data)
    assert weights.shape == att.shape
    np.testing.assert_allclose(weights, att, rtol=0, atol=float(steps.max()) / 2 + 1e-12)
    assert len(paths["html"].read_bytes()) < 200_000


@pytest.mark.parametrize(
    ("shape", "bits"),
    [
        pytest.param((2, 3, 7), 16, id="16-bit"),
        pytest.param((1, 2, 1100), 8, id="8-bit"),  # 2.4M weights, over HTML_16BIT_MAX
    ],
)
def test_html_weights_decode_within_half_a_step(
    tmp_path: Path, shape: tuple[int, int, int], bits: int
) -> None:
    att = softmax_maps(*shape)
    att[0, -1] = 0.0  # an all-zero map, as a fully masked head gives: its step is 0
    att[-1, 0, 1, 2] = -5e-4  # softmax rounding noise below 0 is stored as 0
    page = write_html(tmp_path / "a.html", att, ["t"] * shape[2]).read_text(encoding="utf-8")
    data = embedded_data(page)
    assert data["bits"] == bits
    weights, steps = decoded(data)
    np.testing.assert_array_equal(steps * (2**bits - 1), att.clip(min=0).max(axis=(2, 3)))
    assert (weights[0, -1] == 0).all()
    assert weights[-1, 0, 1, 2] == 0
    att[-1, 0, 1, 2] = 0
    error = np.abs(weights - att)
    bound = steps[:, :, None, None] / 2 + 1e-12
    assert (error <= bound).all(), f"off by {float((error / bound).max()):.3f} half steps"


def test_html_escapes_tokens_and_title(tmp_path: Path) -> None:
    tokens = ["<b>&", "</script><script>alert(1)</script>", "'q'", '"qq"', "<!--"]
    path = write_html(tmp_path / "a.html", softmax_maps(1, 2, 5), tokens, title="<i>A & B</i>")
    page = path.read_text(encoding="utf-8")
    for raw in ("<b>", "<script>alert", "</script><script>", "<i>", "<!--"):
        assert raw not in page
    assert "&lt;i&gt;A &amp; B&lt;/i&gt;" in page
    assert embedded_data(page)["tokens"] == tokens  # the escaped JSON decodes to the same text


HOSTILE_TEXT = (
    "__TITLE__ __SUBTITLE__ __DATA__ __NAME__ </script><script>alert(1)</script> <!-- -->"
    " </title> \"q\" 'q' {{x}} {0} ${y} $1 \\1 \\g<0> %s & &amp; \u2028\u2029 \udcff end"
)


def _template() -> str:
    folder, name = maps_module.TEMPLATE
    path = resources.files("attnkit.inspect").joinpath(folder).joinpath(name)
    return path.read_text(encoding="utf-8")


def test_html_template_has_each_placeholder_where_expected() -> None:
    template = _template()
    assert re.findall(r"__([A-Z]+)__", template) == ["TITLE", "TITLE", "SUBTITLE", "DATA"]
    assert "<title>__TITLE__</title>" in template
    assert "<h1>__TITLE__</h1>" in template
    assert '<script type="application/json" id="attn-data">__DATA__</script>' in template


def test_html_fills_its_template_once_whatever_the_text(tmp_path: Path) -> None:
    """Every placeholder name, a script end, a comment, quotes, braces, dollars, backslashes and
    a lone surrogate (undecodable bytes) in the title and the tokens: the template's
    placeholders are filled exactly once, the title is shown escaped, the JSON stays in its
    block and decodes to the tokens."""
    tokens = [HOSTILE_TEXT, "__DATA__", "</script>", "<!--", "\\", "$&", "\u2028", "\udcff"]
    att = softmax_maps(2, 3, len(tokens))
    title = "model __DATA__: " + HOSTILE_TEXT
    page = write_html(tmp_path / "a.html", att, tokens, title=title).read_text(encoding="utf-8")
    shown = html.escape(title.replace("\udcff", "\ufffd"))
    parts = re.split(r"__[A-Z]+__", _template())  # the template's text around its placeholders
    assert len(parts) == 5
    subtitle = "2 layers × 3 heads, 8 tokens"
    start = parts[0] + shown + parts[1] + shown + parts[2] + subtitle + parts[3]
    assert page.startswith(start)  # the title twice, escaped; the subtitle once
    assert page.endswith(parts[4])  # the page's code after the data block, untouched
    data = page[len(start) : len(page) - len(parts[4])]  # the data block's content, whole
    assert not re.search(r"[<>&\u2028\u2029]", data)
    assert data.isascii()
    payload = json.loads(data)
    assert payload["tokens"] == tokens
    assert (payload["layers"], payload["heads"]) == (2, 3)
    for name in ("TITLE", "SUBTITLE", "DATA", "NAME"):  # the text's own, shown as text
        placeholder = f"__{name}__"
        in_text = 2 * title.count(placeholder) + sum(t.count(placeholder) for t in tokens)
        assert page.count(placeholder) == in_text, placeholder
    assert page.count("</script>") == 2
    assert page.count("<script") == 2
    assert "<!--" not in page


# ---------------------------------------------------------------------------------------------
# bad input: every case reads the message


GOOD_ATT = softmax_maps(2, 3, 4)
GOOD_TOKENS = ["a", "b", "c", "d"]
GOOD_HIDDEN = np.zeros((4, 8), dtype=np.float32)
NAN_ATT = GOOD_ATT.copy()
NAN_ATT[1, 2, 3, 0] = np.nan

BAD_INPUTS = [
    pytest.param(GOOD_ATT[0], GOOD_TOKENS, GOOD_HIDDEN, "attentions", "is 3-D", id="3-D"),
    pytest.param(
        GOOD_ATT[:, None], GOOD_TOKENS, GOOD_HIDDEN, "attentions", "attentions[:, 0]", id="batch"
    ),
    pytest.param(GOOD_ATT[..., :3], GOOD_TOKENS, GOOD_HIDDEN, "attentions", "square", id="L!=S"),
    pytest.param(GOOD_ATT, GOOD_TOKENS[:3], GOOD_HIDDEN, "tokens", "T=4 tokens, but 3", id="len"),
    pytest.param(GOOD_ATT, "abcd", GOOD_HIDDEN, "tokens", "sequence of token strings", id="str"),
    pytest.param(GOOD_ATT, [1, 2, 3, 4], GOOD_HIDDEN, "tokens", "convert_ids_to_tokens", id="ids"),
    pytest.param(GOOD_ATT.tolist(), GOOD_TOKENS, GOOD_HIDDEN, "attentions", "a list", id="list"),
    pytest.param(NAN_ATT, GOOD_TOKENS, GOOD_HIDDEN, "attentions", "(1, 2, 3, 0)", id="nan"),
    pytest.param(GOOD_ATT * 5 - 2, GOOD_TOKENS, GOOD_HIDDEN, "attentions", "not the raw", id="raw"),
    pytest.param(GOOD_ATT, GOOD_TOKENS, GOOD_HIDDEN[:3], "hidden", "(T=4, E)", id="hidden-T"),
    pytest.param(GOOD_ATT, GOOD_TOKENS, GOOD_HIDDEN[None], "hidden", "hidden[0]", id="hidden-3D"),
]


@pytest.mark.parametrize(("att", "tokens", "hidden", "argument", "phrase"), BAD_INPUTS)
def test_bad_input_is_named(
    tmp_path: Path, att: object, tokens: object, hidden: object, argument: str, phrase: str
) -> None:
    out = tmp_path / "out"
    with pytest.raises(AttentionInputError) as info:
        write_all(out, att, tokens, hidden)  # type: ignore[arg-type]
    err = info.value
    assert err.argument == argument
    assert phrase in str(err), str(err)
    assert str(err).startswith("attnkit.inspect.write_all: ")
    assert not out.exists(), "inputs are checked before anything is written"


@pytest.mark.parametrize("writer", [write_png, write_html])
def test_each_writer_checks_its_inputs(tmp_path: Path, writer: object) -> None:
    with pytest.raises(AttentionInputError, match=r"got:\s+attentions \(3-D: 3, 4, 4\)"):
        writer(tmp_path / "x", GOOD_ATT[0], GOOD_TOKENS)  # type: ignore[operator]


def test_out_dir_under_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(AttentionInputError) as info:
        write_all(blocker / "maps", GOOD_ATT, GOOD_TOKENS, GOOD_HIDDEN)
    assert info.value.argument == "out"
    assert "cannot write" in str(info.value)
    assert "choose another output directory" in str(info.value)


def test_out_dir_is_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(AttentionInputError, match="cannot write") as info:
        write_all(blocker, GOOD_ATT, GOOD_TOKENS, GOOD_HIDDEN)
    assert info.value.argument == "out"


def test_read_only_out_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # chmod cannot stop root, who runs these tests in CI; a refused open is what a read-only
    # directory gives any other user
    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(maps_module, "_npz", refuse)
    with pytest.raises(AttentionInputError, match="Permission denied") as info:
        write_all(tmp_path, GOOD_ATT, GOOD_TOKENS, GOOD_HIDDEN)
    assert info.value.argument == "out"
    assert isinstance(info.value.__cause__, PermissionError)


def test_single_writer_path_under_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(AttentionInputError, match="cannot write") as info:
        write_npz(blocker / "a.npz", GOOD_ATT, GOOD_TOKENS, GOOD_HIDDEN)
    assert info.value.argument == "path"
