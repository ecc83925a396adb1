"""transformers models whose weights or masks take another way than the attention function's
keyword arguments, on ``attn_implementation="attnkit"`` against ``eager`` (tiny random models).

- ``output_attentions=True`` where the model does not hand the flag on (GPT-2, GPTBigCode, OPT:
  transformers' output capturing collects the weights) and where it does (Qwen3), from the call,
  the config and in ``generate``; Granite SWA's weights before its sinks.
- the mask function: Bloom (its own attention) is refused; DeepSeek-V4 (its float block bias on
  the mask) gets eager's float mask; which classes skip the interface.

Tolerances: logits ``atol=1e-4``; attention weights ``atol=1e-5`` (float32).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import attnkit
import attnkit.interop.hf_attention as hfa
import attnkit.interop.hf_mask as hm
from attnkit import AttentionInputError
from attnkit.interop import register_hf
from hf_tiny import ATOL_LOGITS, ATOL_WEIGHTS, VOCAB, B, T, batch, pair, tiny_config, transformers

register_hf()


# ---------------------------------------------------------------------------------------------
# output_attentions: the weights come back wherever eager returns them


def _assert_weights_match(got: Any, expected: Any, real: torch.Tensor, heads: int = 4) -> None:
    assert expected is not None
    assert len(expected) == 2
    assert got is not None
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.shape == theirs.shape == (real.shape[0], heads, real.shape[1], real.shape[1])
        rows = real[:, None, :, None].expand_as(mine)  # real query rows
        torch.testing.assert_close(mine[rows], theirs[rows], atol=ATOL_WEIGHTS, rtol=0)
        assert mine[rows].abs().sum() > 0


@pytest.mark.parametrize("name", ["gpt2", "gpt_bigcode", "opt", "qwen3"])
def test_output_attentions_returns_eager_weights(name: str) -> None:
    ref, ours = pair(tiny_config(name))
    ids, mask = batch()
    real = mask.bool()
    with torch.no_grad(), attnkit.trace() as t:
        got = ours(ids, attention_mask=mask, output_attentions=True)
        plain = ours(ids, attention_mask=mask)
    expected = ref(ids, attention_mask=mask, output_attentions=True)
    assert len(t.backends) == 4  # attnkit ran every layer, with and without weights
    torch.testing.assert_close(got.logits[real], expected.logits[real], atol=ATOL_LOGITS, rtol=0)
    _assert_weights_match(got.attentions, expected.attentions, real)
    assert plain.attentions is None


@pytest.mark.parametrize("name", ["gpt2", "opt"])
def test_output_attentions_from_the_config_and_in_generate(name: str) -> None:
    config = tiny_config(name)
    config.output_attentions = True
    ref, ours = pair(config)
    ids, mask = batch()
    real = mask.bool()
    with torch.no_grad():
        _assert_weights_match(ours(ids, attention_mask=mask).attentions,
                              ref(ids, attention_mask=mask).attentions, real)  # fmt: skip
    kwargs = {"max_new_tokens": 3, "do_sample": False, "return_dict_in_generate": True}
    expected = ref.generate(ids, attention_mask=mask, **kwargs)
    got = ours.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.attentions) == len(expected.attentions) == 3  # one tuple per step
    _assert_weights_match(got.attentions[0], expected.attentions[0], real)  # the prompt
    for step in (1, 2):  # one new query against the cache
        for mine, theirs in zip(got.attentions[step], expected.attentions[step], strict=True):
            assert mine.shape == theirs.shape == (B, 4, 1, T + step)
            torch.testing.assert_close(mine, theirs, atol=ATOL_WEIGHTS, rtol=0)


def test_granite_swa_weights_are_eager_weights_before_the_sink() -> None:
    """Granite SWA's eager applies its sinks as a scale on the output and returns the softmax
    before it; attnkit's weights carry the sink's share (as gpt-oss's eager returns them):
    they are renormalised for Granite SWA, and its outputs match eager either way."""
    ref, ours = pair(tiny_config("granite_swa"))
    with torch.no_grad():  # sinks start at 0: give them weight, so that they matter
        for model in (ref, ours):
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4))
    ids, mask = batch()
    real = mask.bool()
    with torch.no_grad():
        got = ours(ids, attention_mask=mask, output_attentions=True)
        expected = ref(ids, attention_mask=mask, output_attentions=True)
    torch.testing.assert_close(got.logits[real], expected.logits[real], atol=ATOL_LOGITS, rtol=0)
    _assert_weights_match(got.attentions, expected.attentions, real)
    rows = real[:, None, :, None].expand_as(got.attentions[0])
    sums = got.attentions[0].sum(-1, keepdim=True).expand_as(got.attentions[0])[rows]
    torch.testing.assert_close(sums, torch.ones_like(sums))


# ---------------------------------------------------------------------------------------------
# the mask function: models whose masks take another way


def test_a_model_whose_attention_skips_the_interface_is_refused() -> None:
    """Bloom builds its masks through the mask interface but runs its own attention (ALiBi):
    on attnkit's bool mask it gave other logits, and attnkit never ran."""
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    ref, ours = pair(config)
    ids, mask = batch()
    with pytest.raises(AttentionInputError) as info, attnkit.trace() as t:
        ours(ids, attention_mask=mask)
    assert t.backends == []
    message = str(info.value)
    assert message.startswith("attnkit.interop.hf_mask (BloomModel): BloomModel's attention ")
    assert "do not call transformers' AttentionInterface" in message
    assert 'attn_implementation="attnkit" would not run attnkit' in message
    assert "got:      model_type 'bloom', attn_implementation='attnkit'" in message
    assert 'fix:      load this model with attn_implementation="eager"' in message
    assert info.value.argument == "attn_implementation"
    with torch.no_grad():
        ref(ids, attention_mask=mask)  # eager runs it


def _deepseek_v4() -> Any:
    return transformers.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, q_lora_rank=16,
        num_experts_per_tok=2, n_routed_experts=4, sliding_window=4, index_n_heads=2,
        index_head_dim=8, index_topk=4, qk_rope_head_dim=8, o_lora_rank=16, o_groups=2,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
        pad_token_id=0,
    )  # fmt: skip


def test_deepseek_v4_gets_eager_float_mask_and_matches_eager() -> None:
    """DeepSeek-V4 appends its compressor's float bias to the mask with
    ``.to(attention_mask.dtype)``: on a bool mask that turned blocked into allowed."""
    ref, ours = pair(_deepseek_v4())
    ids, mask = batch()
    real = mask.bool()
    seen: list[torch.Tensor] = []
    real_attention = hfa.attention

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["mask"])
        return real_attention(*args, **kwargs)

    with torch.no_grad(), pytest.MonkeyPatch.context() as m:
        m.setattr(hfa, "attention", recording)
        got = ours(ids, attention_mask=mask).logits
        expected = ref(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[real], expected[real], atol=ATOL_LOGITS, rtol=0)
    assert len(seen) == 2
    # the layer that appends its bias made eager's float mask from the lazy one; the other
    # handed the lazy mask on, and attnkit ran its spec
    assert isinstance(seen[1], torch.Tensor)
    assert seen[1].dtype == torch.float32
    assert seen[1].shape[-1] > T  # the compressed entries appended by the model's code


@pytest.mark.parametrize(
    ("name", "skips"),
    [("BloomModel", True), ("TrOCRForCausalLM", True), ("XGLMModel", True),
     ("LlamaModel", False), ("GPT2Model", False), ("PaliGemmaModel", False)],
)  # fmt: skip
def test_which_models_skip_the_interface_is_transformers_own_answer(name: str, skips: bool) -> None:
    cls = getattr(transformers, name)
    assert hm._skips_the_interface(cls) is skips
    assert (not cls._can_set_attn_implementation()) is skips


def test_a_model_class_whose_source_cannot_be_read_is_not_refused() -> None:
    """A model defined in a notebook: its source is not there to read, so it is not refused
    (transformers' own check answers False there)."""
    notebook = type("NotebookModel", (transformers.BloomModel,), {"__module__": "__notebook__"})
    assert hm._skips_the_interface(notebook) is False
