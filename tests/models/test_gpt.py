"""The GPT decoder and attnkit.interop.from_hf against Hugging Face transformers.

Both sides are built from one small config with random weights (nothing is downloaded):
transformers' ``GPT2LMHeadModel`` / ``BertModel`` with eager attention, and attnkit's model from
:func:`attnkit.interop.from_hf`. Logits must agree within 1e-4 with and without the KV cache,
greedy generation token for token (same prompts, batched and ragged), and BERT's hidden states
within 1e-4 and attention weights within 1e-5.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from attnkit import AttentionInputError
from attnkit.interop import from_hf
from attnkit.interop.hf import hf_gpt2_state_dict
from attnkit.models import GPT, BertEncoder, GPTConfig
from attnkit.modules.transformer import TransformerConfig

ATOL_LOGITS = 1e-4
ATOL_HIDDEN = 1e-4
ATOL_WEIGHTS = 1e-5
VOCAB = 211


@pytest.fixture(scope="module")
def transformers() -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"
    module = pytest.importorskip("transformers")
    module.logging.set_verbosity_error()
    return module


@pytest.fixture(scope="module")
def hf_gpt2(transformers: Any) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=48,
        n_layer=3,
        n_head=4,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    config._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # biases and LayerNorms away from their init: every weight counts
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def gpt(hf_gpt2: Any) -> GPT:
    model = from_hf(hf_gpt2)
    assert isinstance(model, GPT)
    return model


def test_gpt2_config_and_weights_map(hf_gpt2: Any, gpt: GPT) -> None:
    c = gpt.config
    assert (c.vocab_size, c.max_positions, c.dim, c.num_layers, c.num_heads) == (
        VOCAB,
        64,
        48,
        3,
        4,
    )
    assert c.activation == "gelu_tanh"
    assert not gpt.training
    assert gpt.lm_head.weight is gpt.tok_emb.weight  # tied, as GPT-2's
    c_attn = hf_gpt2.transformer.h[1].attn.c_attn.weight  # Conv1D (in, out) = (E, 3E)
    attn = gpt.stack.layers[1].attn
    assert torch.equal(attn.k_proj.weight, c_attn[:, 48:96].T)


def test_gpt2_logits_match_without_cache(hf_gpt2: Any, gpt: GPT) -> None:
    ids = torch.randint(0, VOCAB, (3, 20))
    with torch.no_grad():
        ref = hf_gpt2(ids).logits
        got = gpt(ids)
    assert got.shape == (3, 20, VOCAB)
    torch.testing.assert_close(got, ref, atol=ATOL_LOGITS, rtol=0)
    print(f"GPT-2 logits, no cache: max abs diff {(got - ref).abs().max().item():.2e}")


def test_gpt2_logits_match_with_cache(transformers: Any, hf_gpt2: Any, gpt: GPT) -> None:
    ids = torch.randint(0, VOCAB, (2, 16))
    chunks = [6, 1, 1, 4, 1, 1, 1, 1]
    cache = gpt.new_cache(2, max_len=16)
    hf_cache = transformers.DynamicCache()
    ours, theirs, t = [], [], 0
    with torch.no_grad():
        ref_full = hf_gpt2(ids).logits
        for n in chunks:
            ours.append(gpt(ids[:, t : t + n], kv_cache=cache))
            out = hf_gpt2(ids[:, t : t + n], past_key_values=hf_cache, use_cache=True)
            hf_cache = out.past_key_values
            theirs.append(out.logits)
            t += n
    got, ref = torch.cat(ours, dim=1), torch.cat(theirs, dim=1)
    torch.testing.assert_close(got, ref, atol=ATOL_LOGITS, rtol=0)
    torch.testing.assert_close(got, ref_full, atol=ATOL_LOGITS, rtol=0)
    print(f"GPT-2 logits, cache: max abs diff {(got - ref).abs().max().item():.2e}")


def test_gpt2_padded_logits_match(hf_gpt2: Any, gpt: GPT) -> None:
    """Left padding with Hugging Face's positions (cumsum of the mask - 1)."""
    ids = torch.randint(1, VOCAB, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf_gpt2(ids, attention_mask=mask, position_ids=positions).logits
        got = gpt(ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=ATOL_LOGITS, rtol=0)


def test_gpt2_greedy_generation_is_token_for_token(hf_gpt2: Any, gpt: GPT) -> None:
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        ref = hf_gpt2.generate(ids, max_new_tokens=24, do_sample=False)
    with_cache = gpt.generate(ids, 24)
    without = gpt.generate(ids, 24, use_cache=False)
    assert with_cache.shape == (2, 32)
    assert torch.equal(with_cache, ref)
    assert torch.equal(without, ref)


def test_gpt2_ragged_generation_matches_left_padded_transformers(hf_gpt2: Any, gpt: GPT) -> None:
    lengths = [9, 4, 6]
    ids = torch.zeros(3, 9, dtype=torch.long)
    left = torch.zeros(3, 9, dtype=torch.long)
    prompts = [torch.randint(1, VOCAB, (n,)) for n in lengths]
    for b, p in enumerate(prompts):
        ids[b, 9 - len(p) :] = p
        left[b, 9 - len(p) :] = 1
    with torch.no_grad():
        ref = hf_gpt2.generate(ids, attention_mask=left, max_new_tokens=12, do_sample=False)
    got = gpt.generate(ids, 12, attention_mask=left)
    assert torch.equal(got, ref)
    assert torch.equal(gpt.generate(ids, 12, attention_mask=left, use_cache=False), ref)
    # the same prompts right-padded, and each prompt alone: the same new tokens
    right_ids = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        right_ids[b, : len(p)] = p
    right = gpt.generate(right_ids, 12, attention_mask=right_ids != 0)
    assert torch.equal(right[:, 9:], ref[:, 9:])
    assert torch.equal(right[:, :9], right_ids)  # the prompt as given, then the new tokens
    for b, p in enumerate(prompts):
        assert torch.equal(gpt.generate(p[None], 12)[0, len(p) :], ref[b, 9:])


def test_sampling_is_seeded_and_top_k_1_is_greedy(gpt: GPT) -> None:
    ids = torch.randint(0, VOCAB, (2, 5))
    greedy = gpt.generate(ids, 6)
    assert torch.equal(gpt.generate(ids, 6, temperature=0.7, top_k=1), greedy)
    a = gpt.generate(ids, 6, temperature=1.0, generator=torch.Generator().manual_seed(1))
    b = gpt.generate(
        ids, 6, temperature=1.0, use_cache=False, generator=torch.Generator().manual_seed(1)
    )
    assert torch.equal(a, b)  # same draws with or without the cache
    assert not torch.equal(a, greedy)
    assert torch.equal(gpt.generate(ids, 0), ids)


def test_generate_errors(gpt: GPT) -> None:
    ids = torch.randint(0, VOCAB, (1, 60))
    gpt.generate(ids, 5)  # the last new token is never fed: 60 + 5 - 1 = 64 positions
    with pytest.raises(AttentionInputError, match="need 65 positions; the model has 64") as e:
        gpt.generate(ids, 6)
    assert "fewer tokens" in str(e.value)
    holes = torch.tensor([[1, 0, 1, 1]])
    with pytest.raises(AttentionInputError, match="one run of real tokens"):
        gpt.generate(torch.ones(1, 4, dtype=torch.long), 2, attention_mask=holes)
    with pytest.raises(AttentionInputError, match="max_new_tokens"):
        gpt.generate(ids[:, :4], -1)
    with pytest.raises(AttentionInputError, match=r"token ids must be in \[0, 211\)"):
        gpt(torch.tensor([[0, 211]]))
    cache = gpt.new_cache(1, 8)
    with pytest.raises(AttentionInputError, match="right-padded"):
        gpt(torch.ones(1, 4, dtype=torch.long), attention_mask=holes, kv_cache=cache)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": float("nan")}, "`temperature` must be a finite number >= 0"),
        ({"temperature": float("inf")}, "`temperature` must be a finite number >= 0"),
        ({"temperature": -1.0}, "got -1.0."),
        ({"temperature": torch.tensor(1.0)}, "got tensor(1.) (a Tensor)."),
        ({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, "there is no prompt to continue"),
        ({"input_ids": torch.zeros(0, 3, dtype=torch.long)}, "there is no prompt to continue"),
        (
            {"attention_mask": torch.tensor([[2, 2, 2]])},
            "`attention_mask` holds values other than 0 and 1: [2]",
        ),
    ],
)
def test_generate_refuses_before_it_runs(gpt: GPT, kwargs: dict[str, Any], message: str) -> None:
    """Each of these reached torch's sampler or argmax as a raw error, or ran silently."""
    args: dict[str, Any] = {"input_ids": torch.ones(1, 3, dtype=torch.long), "max_new_tokens": 2}
    with pytest.raises(AttentionInputError) as e:
        gpt.generate(**(args | kwargs))
    assert message in str(e.value)


def test_untied_head_and_float64(transformers: Any) -> None:
    config = transformers.GPT2Config(
        vocab_size=50,
        n_positions=16,
        n_embd=16,
        n_layer=1,
        n_head=2,
        tie_word_embeddings=False,
        activation_function="gelu",
        bos_token_id=None,
        eos_token_id=None,
    )
    config._attn_implementation = "eager"
    hf = transformers.GPT2LMHeadModel(config).double().train()
    ours = from_hf(hf)
    assert isinstance(ours, GPT)
    assert ours.training
    assert ours.lm_head.weight is not ours.tok_emb.weight
    assert ours.tok_emb.weight.dtype == torch.float64
    hf.eval()
    ours.eval()
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-10, rtol=0)


@pytest.fixture(scope="module")
def hf_bert(transformers: Any) -> Any:
    torch.manual_seed(1)
    config = transformers.BertConfig(
        vocab_size=120,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=32,
    )
    config._attn_implementation = "eager"
    return transformers.BertModel(config).eval()


def test_bert_parity_via_from_hf(hf_bert: Any) -> None:
    ours = from_hf(hf_bert)
    assert isinstance(ours, BertEncoder)
    ids = torch.randint(1, 120, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 7:] = 0
    ids[1, 7:] = 0
    types = torch.zeros_like(ids)
    types[:, 5:] = 1
    with torch.no_grad():
        ref = hf_bert(
            input_ids=ids,
            attention_mask=mask,
            token_type_ids=types,
            output_attentions=True,
            output_hidden_states=True,
        )
        got = ours(ids, mask, types, need_weights=True, output_hidden_states=True)
    for mine, theirs in zip(got.hidden_states, ref.hidden_states, strict=True):
        torch.testing.assert_close(mine, theirs, atol=ATOL_HIDDEN, rtol=0)
    for mine, theirs in zip(got.attentions, ref.attentions, strict=True):
        torch.testing.assert_close(mine, theirs, atol=ATOL_WEIGHTS, rtol=0)
    hidden = (got.last_hidden_state - ref.last_hidden_state).abs().max().item()
    weights = max(
        (a - b).abs().max().item() for a, b in zip(got.attentions, ref.attentions, strict=False)
    )
    print(f"BERT: hidden max abs diff {hidden:.2e}, attentions {weights:.2e}")


def test_from_hf_rejects_other_models(transformers: Any) -> None:
    gpt2_body = transformers.GPT2Model(
        transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=30, n_positions=8)
    )
    with pytest.raises(AttentionInputError, match="cannot convert a GPT2Model") as e:
        from_hf(gpt2_body)
    assert "GPT2LMHeadModel or BertModel" in str(e.value)
    with pytest.raises(AttentionInputError, match="cannot convert a Linear"):
        from_hf(nn.Linear(2, 2))
    config = transformers.GPT2Config(
        n_embd=16, n_layer=1, n_head=2, vocab_size=30, n_positions=8, scale_attn_weights=False
    )
    with pytest.raises(AttentionInputError, match="scale_attn_weights"):
        from_hf(transformers.GPT2LMHeadModel(config))


@pytest.mark.parametrize(
    "setting",
    [{"is_decoder": True}, {"is_decoder": True, "add_cross_attention": True}],
    ids=["is_decoder", "cross-attention"],
)
def test_from_hf_refuses_a_bert_that_is_not_the_encoder(
    transformers: Any, setting: dict[str, bool]
) -> None:
    """A decoder BERT attends causally: converting it to attnkit's (bidirectional) encoder
    would give other hidden states silently; it is refused."""
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=48, **setting,
    )  # fmt: skip
    with pytest.raises(AttentionInputError) as e:
        from_hf(transformers.BertModel(config, add_pooling_layer=False))
    assert "settings attnkit's BertEncoder does not have: is_decoder" in str(e.value)
    assert "is_decoder=True" in str(e.value)


def test_attnkit_import_does_not_load_transformers() -> None:
    code = (
        "import sys, attnkit, attnkit.interop, attnkit.models; "
        "from attnkit.interop import from_hf; "
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gpt_config_validates() -> None:
    with pytest.raises(AttentionInputError, match="`vocab_size` must be a positive int, got 0"):
        GPTConfig(vocab_size=0)
    with pytest.raises(AttentionInputError, match="not divisible by num_heads"):
        GPT(GPTConfig(dim=30, num_heads=4))


def test_gpt_layer_config_takes_every_field_it_shares() -> None:
    c = GPTConfig(
        dim=48,
        num_heads=4,
        ffn_dim=100,
        activation="relu",
        norm_eps=1e-6,
        dropout=0.1,
        attn_dropout=0.2,
        backend="math",
    )
    assert c.transformer_config() == TransformerConfig(
        dim=48,
        num_heads=4,
        ffn_dim=100,
        activation="relu",
        norm_eps=1e-6,
        norm_first=True,
        dropout=0.1,
        attn_dropout=0.2,
        causal=True,
        backend="math",
    )


def test_gpt2_weight_mapping_lists_unknown_names() -> None:
    state = {
        "transformer.h.0.attn.c_attn.weight": torch.zeros(4, 12),
        "transformer.h.0.mlp.gate.weight": torch.zeros(4, 4),
        "encoder.layer.0.output.dense.weight": torch.zeros(4, 4),
    }
    with pytest.raises(AttentionInputError) as e:
        hf_gpt2_state_dict(state)
    assert e.value.argument == "state_dict"
    assert e.value.problem == "2 weight name(s) are not Hugging Face GPT-2 weights."
    assert e.value.got == (
        "unexpected: transformer.h.0.mlp.gate.weight, encoder.layer.0.output.dense.weight"
    )
    assert (
        e.value.expected
        == "names like h.{i}.attn.c_attn.weight (optionally with a transformer. prefix)"
    )
    assert e.value.fix is not None
    assert "a GPT-2 checkpoint?" in e.value.fix
