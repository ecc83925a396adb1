"""``attnkit show --model DIR``: the attention maps of a local transformers checkpoint, on attnkit.

Dimension legend: N layers, H heads, T tokens (the tokenizer's special tokens included), E hidden
width.

:func:`show_model` is what ``attnkit show --model DIR`` runs. ``DIR`` is a checkpoint directory
as ``save_pretrained`` writes it: ``config.json``, the weights (``*.safetensors``) and the
tokenizer files; an encoder (BERT-like) or a decoder (Llama-like). ``DIR`` is a directory attnkit
did not write: :func:`attnkit.model_dir.check_model_dir` refuses links, code (``*.py``, an
``auto_map`` in any JSON file) and pickles in it before any file is read, and every transformers
load passes ``trust_remote_code=False`` (it never asks whether to run the directory's code). The
model is loaded offline with ``AutoModel.from_pretrained(DIR, attn_implementation="attnkit",
use_safetensors=True)`` after :func:`attnkit.interop.register_hf`, in float32, and run once with
``output_attentions=True`` under :func:`attnkit.trace`; the maps go to the same writers as the
default ``attnkit show`` (:func:`attnkit.inspect.write_all`). Everything that can be checked
without the weights (the output directory, the text, the directory and its files, the config,
the layer and the head) is checked before the model is loaded; every bad input raises
:class:`~attnkit.AttentionInputError`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from attnkit.errors import AttentionInputError
from attnkit.inspect.show import (
    ShowResult,
    Truncation,
    check_out_dir,
    check_unicode,
    write_maps,
)
from attnkit.inspect.tracing import trace
from attnkit.model_dir import HF_LOAD, HF_WEIGHTS
from attnkit.model_dir import check_model_dir as check_files

__all__ = ["STEPS", "check_model_dir", "show_model"]

#: The steps :func:`show_model` reports to its ``progress`` callback, in order.
STEPS = ("load model", "tokenize", "run the model", "write html, png, npz")
WHERE = "attnkit show --model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "tokenizer.model")
_TAIL_CHARS = 32


def _bad_model(path: Path, problem: str, expected: str, fix: str) -> AttentionInputError:
    return AttentionInputError(
        WHERE, "model", problem, got=f"--model {path}", expected=expected, fix=fix
    )


CHECKPOINT = "a transformers checkpoint directory: config.json, *.safetensors, tokenizer files"
SAVE_FIX = "point --model at a directory written by model.save_pretrained(DIR) and "
SAVE_FIX += "tokenizer.save_pretrained(DIR)"


def _weights(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


@contextmanager
def _quiet_transformers() -> Iterator[Any]:
    """transformers, with its logging at errors only and its progress bars off, restored after."""
    transformers = importlib.import_module("transformers")
    logging = transformers.utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield transformers
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def check_model_dir(model_dir: str | os.PathLike[str]) -> Any:
    """The checkpoint's config, after checking the directory holds what :func:`show_model` needs.

    Raises :class:`~attnkit.AttentionInputError` (argument ``model``) for a missing path, a file,
    a directory that breaks :func:`attnkit.model_dir.check_model_dir` (a link, code, a pickle), a
    directory without ``config.json``, without weights or without tokenizer files, a config
    transformers cannot read, an encoder-decoder model, or no transformers installed. The weights
    are not read here.
    """
    path = Path(model_dir)
    if not path.exists():
        raise _bad_model(
            path, f"the model directory {str(path)!r} does not exist.", CHECKPOINT, SAVE_FIX
        )
    if not path.is_dir():
        raise _bad_model(
            path, f"{str(path)!r} is a file, not a checkpoint directory.", CHECKPOINT, SAVE_FIX
        )
    check_files(path, where=WHERE, argument="model", got=f"--model {path}")
    if not (path / "config.json").is_file():
        raise _bad_model(
            path,
            f"{str(path)!r} has no config.json.",
            CHECKPOINT,
            "save the config too (model.save_pretrained(DIR) writes it)",
        )
    if not _weights(path):
        raise _bad_model(
            path,
            f"{str(path)!r} has no weights (*.safetensors).",
            CHECKPOINT,
            "save the weights: model.save_pretrained(DIR)",
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise _bad_model(
            path,
            f"{str(path)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}).",
            CHECKPOINT,
            "save the model's tokenizer into it: tokenizer.save_pretrained(DIR)",
        )
    try:
        with _quiet_transformers() as transformers:
            config = transformers.AutoConfig.from_pretrained(path, **HF_LOAD)
    except ImportError as e:
        raise _bad_model(
            path,
            f"reading a checkpoint needs transformers: {e}",
            "transformers>=5.4,<6 installed",
            "pip install 'attnkit[hf]'",
        ) from e
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _bad_model(
            path,
            f"transformers cannot read {str(path / 'config.json')!r}: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}",
            CHECKPOINT,
            "check the config.json (its model_type above all)",
        ) from e
    if getattr(config, "is_encoder_decoder", False):
        raise _bad_model(
            path,
            f"{config.model_type} is an encoder-decoder model; "
            "attnkit show maps one stack of self-attention.",
            "an encoder (BERT-like) or a decoder (Llama-like) checkpoint",
            "pass an encoder or a decoder checkpoint",
        )
    return config


def _check_index(name: str, value: int, count: int, what: str, model: str) -> None:
    if not 0 <= value < count:
        raise AttentionInputError(
            WHERE,
            name,
            f"{name} {value} does not exist: {model} has {count} {what}, "
            f"numbered 0 to {count - 1}.",
            got=f"{name}={value}",
            expected=f"0 <= {name} <= {count - 1}",
            fix=f"choose a {name} from 0 to {count - 1}",
        )


def _tokenize(
    text: str, tokenizer: Any, max_tokens: int | None, truncate: bool
) -> tuple[list[str], torch.Tensor, Truncation | None]:
    """Tokens, input ids ``(1, T)`` and what was cut, or an error naming the token count."""
    full = tokenizer(text, return_special_tokens_mask=True)
    ids: list[int] = list(full["input_ids"])
    if all(full["special_tokens_mask"]):
        raise AttentionInputError(
            WHERE,
            "text",
            "the text is empty: it has no tokens besides the tokenizer's special tokens.",
            got=f"text={text[:40]!r}",
            expected="a text with at least one word",
            fix="pass a text with at least one word",
        )
    cut = None
    if max_tokens is not None and len(ids) > max_tokens:
        if not truncate:
            raise AttentionInputError(
                WHERE,
                "text",
                f"the text has {len(ids)} tokens (special tokens included), more than the "
                f"model's {max_tokens} positions.",
                got=f"text={text[:40]!r}... ({len(text)} characters, {len(ids)} tokens)",
                expected=f"at most {max_tokens} tokens",
                fix=f"add --truncate to keep the first {max_tokens} tokens, or shorten the text",
            )
        kept = tokenizer(
            text,
            truncation=True,
            max_length=max_tokens,
            return_offsets_mapping=True,
            return_special_tokens_mask=True,
        )
        spans = [
            s
            for s, special in zip(kept["offset_mapping"], kept["special_tokens_mask"], strict=True)
            if not special
        ]
        end = int(spans[-1][1]) if spans else 0
        tail = text[:end]
        tail = tail if len(tail) <= _TAIL_CHARS else "…" + tail[-_TAIL_CHARS:].split(" ", 1)[-1]
        cut = Truncation(
            total=len(ids), kept=len(kept["input_ids"]), kept_chars=end, kept_tail=tail
        )
        ids = list(kept["input_ids"])
    tokens = [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
    return tokens, torch.tensor([ids]), cut


def _attention_modules(model: torch.nn.Module) -> list[str]:
    """The qualified names of the innermost modules named ``*Attention``, in order."""
    found = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("Attention")]
    inner = [
        n
        for n, m in found
        if not any(type(c).__name__.endswith("Attention") for c in m.modules() if c is not m)
    ]
    return inner


def _load_checkpoint(path: Path) -> tuple[Any, Any]:
    """The tokenizer and the model (on attnkit, float32, in eval mode) of a checked directory."""
    from attnkit.interop import register_hf

    implementation = register_hf()
    with _quiet_transformers() as transformers:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, **HF_LOAD)
            model = transformers.AutoModel.from_pretrained(
                path,
                attn_implementation=implementation,
                dtype=torch.float32,
                **HF_WEIGHTS,
            )
        except Exception as e:  # any failure of transformers' loader: not loadable
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise _bad_model(
                path, f"transformers cannot load {str(path)!r}: {first}", CHECKPOINT, SAVE_FIX
            ) from e
    model.eval()
    return tokenizer, model


def _check_maps_returned(
    path: Path, model_type: str, num_calls: int, attentions: Any, num_layers: int
) -> None:
    """Refuse a run whose attention did not go through attnkit, or whose maps cannot be
    matched to its layers (one attnkit call and one map per layer)."""
    calls = f"{num_calls} attnkit calls for {num_layers} layers"
    if not num_calls:
        raise _bad_model(
            path,
            f"{model_type} did not run its attention on attnkit ({calls}).",
            "a model whose attention layers use attn_implementation",
            "use the model with transformers directly",
        )
    if not attentions:
        raise _bad_model(
            path,
            f"{model_type} ran its attention on attnkit ({calls}) but returned no "
            "attention weights: its code does not pass output_attentions on to the attention "
            "function.",
            "a model that returns its attention weights with output_attentions=True",
            'use the model with transformers directly (attn_implementation="eager" returns '
            "its weights)",
        )
    if num_calls != len(attentions):
        raise _bad_model(
            path,
            f"{model_type} returned {len(attentions)} attention maps from "
            f"{calls}: they cannot be matched to its layers.",
            "one attention call per layer, each returning its weights",
            "use the model with transformers directly",
        )


def show_model(
    model_dir: str | os.PathLike[str],
    text: str,
    out_dir: str | os.PathLike[str] = "attnkit-out",
    *,
    truncate: bool = False,
    layer: int = 0,
    head: int = 0,
    progress: Callable[[str], None] | None = None,
) -> ShowResult:
    """Run the checkpoint in ``model_dir`` on ``text`` on attnkit and write its attention maps.

    As :func:`attnkit.inspect.show.show_text`, for any local encoder or decoder checkpoint:
    ``text`` may have at most ``config.max_position_embeddings`` tokens (the tokenizer's special
    tokens included) unless ``truncate``; :attr:`ShowResult.backends` holds the attnkit backend
    that served each layer, and :attr:`ShowResult.trace` the shape trace of layer ``layer``'s
    attnkit call. ``progress`` gets each name of :data:`STEPS` as that step starts.
    """
    report = progress or (lambda step: None)
    out = check_out_dir(out_dir)
    if not text.strip():
        raise AttentionInputError(
            WHERE,
            "text",
            "the text is empty.",
            got=f"text={text!r}",
            expected="a text with at least one word",
            fix="pass a text with at least one word",
        )
    check_unicode(WHERE, text)
    path = Path(model_dir)
    config = check_model_dir(path)
    text_config = config.get_text_config()
    name = f"{path.name or path.resolve().name} ({config.model_type})"
    num_layers = int(text_config.num_hidden_layers)
    num_heads = int(text_config.num_attention_heads)
    _check_index("layer", layer, num_layers, "layers", name)
    _check_index("head", head, num_heads, "heads", name)

    report(STEPS[0])
    tokenizer, model = _load_checkpoint(path)

    report(STEPS[1])
    max_tokens = getattr(text_config, "max_position_embeddings", None)
    tokens, input_ids, cut = _tokenize(text, tokenizer, max_tokens, truncate)

    report(STEPS[2])
    with torch.inference_mode(), trace() as t:
        result = model(input_ids=input_ids, output_attentions=True)  # (1, T): no padding
    _check_maps_returned(path, config.model_type, len(t.backends), result.attentions, num_layers)
    attentions = torch.stack([a[0] for a in result.attentions]).float()  # (N, H, T, T)
    hidden = result.last_hidden_state[0].float()  # (T, E)
    modules = _attention_modules(model)
    layer_name = modules[layer] if len(modules) == num_layers else f"layer {layer}"

    report(STEPS[3])
    maps = write_maps(out, name, text, tokens, attentions, hidden, layer, head)
    return ShowResult(
        **maps,
        num_layers=num_layers,
        num_heads=num_heads,
        layer_name=layer_name,
        trace=t.render(call=layer + 1),  # one attnkit call per layer, in order
        truncation=cut,
        model=name,
        backends=tuple(t.backends),
    )
