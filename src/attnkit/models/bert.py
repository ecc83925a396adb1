"""A BERT-style encoder built from attnkit modules.

Dimension legend: B batch, T tokens, E hidden size, H heads, V vocabulary size,
P max positions.

The model is embeddings (word + position + token type, then LayerNorm) followed by a post-norm
:class:`~attnkit.modules.transformer.TransformerStack`; every attention call goes through
:func:`attnkit.attention`. Real weights and the tokenizer are read by :mod:`attnkit.models.bert_io`
(:func:`~attnkit.models.load_bert`, :func:`~attnkit.models.load_minilm`,
:func:`~attnkit.models.encode`); this file reads no files besides ``config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnkit.errors import AttentionInputError, shape_str
from attnkit.models.token_ids import check_token_ids
from attnkit.modules.transformer import (
    Activation,
    TransformerConfig,
    TransformerOutput,
    TransformerStack,
)

__all__ = ["BertConfig", "BertEmbeddings", "BertEncoder", "mean_pool"]

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

    - ``input_ids (B, T)`` integer token ids in ``[0, vocab_size)``,
      ``T <= max_position_embeddings``.
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
        check_token_ids(
            where,
            input_ids,
            self.config.vocab_size,
            source="attnkit.models.encode(texts, tokenizer) gives input_ids and attention_mask",
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
