"""Hugging Face ``transformers`` models into attnkit models: the weight mapping, nothing else.

:func:`from_hf` takes a ``GPT2LMHeadModel`` (-> :class:`~attnkit.models.GPT`) or a
``BertModel`` (-> :class:`~attnkit.models.BertEncoder`) and returns the attnkit model with the
same weights, dtype, device and training mode. It recognises the model by its class names
and reads its ``config`` and ``state_dict()``: ``transformers`` is never imported by attnkit.

GPT-2 keeps its projections in ``Conv1D`` modules whose weights are ``(in, out)``, the
transpose of ``nn.Linear``'s ``(out, in)``; its ``c_attn`` is q, k and v side by side.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from attnkit.errors import AttentionInputError
from attnkit.models import BertConfig, BertEncoder, hf_bert_state_dict
from attnkit.models.gpt import GPT, GPTConfig
from attnkit.models.weight_names import rename_weights
from attnkit.modules.transformer import Activation

__all__ = ["from_hf", "hf_gpt2_state_dict"]

WHERE = "attnkit.interop.from_hf"

# GPT-2's `activation_function` -> TransformerConfig.activation
_GPT2_ACTIVATIONS: dict[str, Activation] = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
}
# transformer.h.{i}.<hf> -> stack.layers.{i}.<attnkit>; Conv1D weights are transposed
_GPT2_LAYER = {
    "ln_1": "attn_norm",
    "attn.c_proj": "attn.out_proj",
    "ln_2": "mlp_norm",
    "mlp.c_fc": "mlp.fc_in",
    "mlp.c_proj": "mlp.fc_out",
}
_GPT2_CONV1D = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}
_GPT2_TOP = {
    "wte.weight": "tok_emb.weight",
    "wpe.weight": "pos_emb.weight",
    "ln_f.weight": "stack.final_norm.weight",
    "ln_f.bias": "stack.final_norm.bias",
}
# buffers of older checkpoints (the causal mask), not weights
_GPT2_IGNORED = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")


def from_hf(model: Any) -> GPT | BertEncoder:
    """The attnkit model with the weights of a Hugging Face ``GPT2LMHeadModel`` or ``BertModel``.

    ``GPT2LMHeadModel`` gives a :class:`~attnkit.models.GPT` (same logits; ``generate``
    decodes greedily with a KV cache); ``BertModel`` gives a
    :class:`~attnkit.models.BertEncoder` (same hidden states and attentions; the pooler is
    dropped). The weights are copied; dtype, device and ``training`` follow ``model``.
    Anything else raises an :class:`~attnkit.AttentionInputError`.

    >>> import transformers
    >>> config = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=16, n_layer=2,
    ...                                  n_head=2, bos_token_id=None, eos_token_id=None)
    >>> gpt = from_hf(transformers.GPT2LMHeadModel(config).eval())
    >>> type(gpt).__name__, gpt.config.num_layers, gpt.training
    ('GPT', 2, False)
    """
    names = [c.__name__ for c in type(model).__mro__]
    if "GPT2LMHeadModel" in names:
        ours: GPT | BertEncoder = GPT(_gpt2_config(model.config))
        state = hf_gpt2_state_dict(model.state_dict())
    elif "BertModel" in names:
        _check_bert_config(model.config)
        ours = BertEncoder(BertConfig.from_dict(model.config.to_dict()))
        state = hf_bert_state_dict(model.state_dict())
    else:
        raise AttentionInputError(
            WHERE,
            "model",
            f"cannot convert a {type(model).__name__}.",
            got=f"model: {type(model).__module__}.{type(model).__name__}",
            expected="a transformers GPT2LMHeadModel or BertModel",
            fix="for a BERT with heads (BertForMaskedLM, ...) pass its .bert; for GPT2Model "
            "wrap it in GPT2LMHeadModel",
        )
    first = next(iter(state.values()))
    ours.to(device=first.device, dtype=first.dtype)
    result = ours.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not _tied(ours, k)]
    if missing or result.unexpected_keys:
        raise AttentionInputError(
            WHERE,
            "model",
            "the model's weights do not match the architecture its config describes.",
            got=f"missing: {missing[:6]}  unexpected: {result.unexpected_keys[:6]}",
            expected="every weight of the attnkit model, and no other",
        )
    return ours.train(bool(model.training))


def _tied(model: GPT | BertEncoder, key: str) -> bool:
    """A tied LM head has no weight of its own in a GPT-2 checkpoint without ``lm_head``."""
    return isinstance(model, GPT) and model.config.tie_embeddings and key == "lm_head.weight"


def _check_bert_config(c: Any) -> None:
    """attnkit's BertEncoder is the bidirectional encoder with absolute positions: a BERT
    config asking for anything else is refused (it would otherwise load and compute another
    model)."""
    unsupported = {
        "is_decoder": bool(getattr(c, "is_decoder", False)),
        "add_cross_attention": bool(getattr(c, "add_cross_attention", False)),
        "position_embedding_type": getattr(c, "position_embedding_type", "absolute")
        not in (None, "absolute"),
    }
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise AttentionInputError(
            WHERE,
            "model",
            f"this BERT config uses settings attnkit's BertEncoder does not have: "
            f"{', '.join(bad)} (its attention would differ: causal, cross-attention or "
            "relative positions).",
            got=", ".join(f"{name}={getattr(c, name, None)!r}" for name in bad),
            expected="is_decoder=False, add_cross_attention=False, "
            "position_embedding_type='absolute'",
            fix='run it in transformers, with attn_implementation="attnkit" '
            "(attnkit.interop.register_hf) for attnkit's attention",
        )


def _gpt2_config(c: Any) -> GPTConfig:
    """A :class:`~attnkit.models.GPTConfig` from a transformers ``GPT2Config``."""
    unsupported = {
        "activation_function": c.activation_function not in _GPT2_ACTIVATIONS,
        "scale_attn_weights": not c.scale_attn_weights,
        "scale_attn_by_inverse_layer_idx": c.scale_attn_by_inverse_layer_idx,
        "add_cross_attention": getattr(c, "add_cross_attention", False),
    }
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise AttentionInputError(
            WHERE,
            "model",
            f"this GPT-2 config uses settings attnkit's GPT does not have: {', '.join(bad)}.",
            got=", ".join(f"{name}={getattr(c, name, None)!r}" for name in bad),
            expected=f"activation_function in {sorted(_GPT2_ACTIVATIONS)}, "
            "scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, "
            "add_cross_attention=False",
        )
    return GPTConfig(
        vocab_size=c.vocab_size,
        max_positions=c.n_positions,
        dim=c.n_embd,
        num_layers=c.n_layer,
        num_heads=c.n_head,
        ffn_dim=c.n_inner,
        activation=_GPT2_ACTIVATIONS[c.activation_function],
        norm_eps=c.layer_norm_epsilon,
        embed_dropout=c.embd_pdrop,
        dropout=c.resid_pdrop,
        attn_dropout=c.attn_pdrop,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
    )


def hf_gpt2_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face GPT-2 state dict renamed (and transposed) for :class:`~attnkit.models.GPT`.

    ``Conv1D`` weights ``(in, out)`` are transposed to ``nn.Linear``'s ``(out, in)``;
    ``c_attn`` ``(E, 3E)`` splits into the q, k and v projections. A ``transformer.`` prefix is
    stripped; the causal-mask buffers of older checkpoints are dropped; any other unknown name
    raises.

    >>> sd = hf_gpt2_state_dict({"transformer.h.0.attn.c_attn.weight": torch.zeros(4, 12)})
    >>> {k: tuple(v.shape) for k, v in sd.items()}  # doctest: +NORMALIZE_WHITESPACE
    {'stack.layers.0.attn.q_proj.weight': (4, 4), 'stack.layers.0.attn.k_proj.weight': (4, 4),
     'stack.layers.0.attn.v_proj.weight': (4, 4)}
    """
    return rename_weights(
        state_dict,
        _gpt2_to_attnkit,
        where="attnkit.interop.hf_gpt2_state_dict",
        model="GPT-2",
        prefix="transformer.",
        ignored=_GPT2_IGNORED,
        example="h.{i}.attn.c_attn.weight",
    )


def _gpt2_to_attnkit(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """One GPT-2 weight under attnkit's names (``c_attn`` gives three), or None if unknown."""
    if key in _GPT2_TOP:
        return {_GPT2_TOP[key]: tensor}
    if key == "lm_head.weight":
        return {key: tensor}
    m = re.fullmatch(r"h\.(\d+)\.(.+)\.(weight|bias)", key)
    if m is None:
        return None
    i, module, param = m.groups()
    prefix = f"stack.layers.{i}"
    if module in _GPT2_CONV1D and param == "weight":
        tensor = tensor.t()  # Conv1D (in, out) -> Linear (out, in)
    if module == "attn.c_attn":
        q, k, v = tensor.chunk(3, dim=0)  # (3E, E) or (3E,) -> three (E, ...)
        parts = (("q_proj", q), ("k_proj", k), ("v_proj", v))
        return {f"{prefix}.attn.{part}.{param}": t.contiguous() for part, t in parts}
    if module in _GPT2_LAYER:
        return {f"{prefix}.{_GPT2_LAYER[module]}.{param}": tensor.contiguous()}
    return None
