"""``attnkit.interop.use_by_default()``: models loaded without ``attn_implementation`` run on
attnkit where transformers' default would be ``sdpa``; everything else keeps transformers'
choice, and transformers' default comes back when the handle ends.

Tolerances: logits ``atol=1e-4`` (float32), as in ``hf_tiny``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import attnkit
from attnkit import AttentionInputError
from attnkit.interop import use_by_default
from hf_tiny import ATOL_LOGITS, batch, tiny_config, transformers


def _default_impl(config_name: str = "qwen3") -> str:
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(config_name))
    return str(model.config._attn_implementation)


def test_models_loaded_without_a_name_run_on_attnkit_and_match_sdpa() -> None:
    config = tiny_config("qwen3")
    torch.manual_seed(0)
    sdpa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    assert sdpa.config._attn_implementation == "sdpa"
    with use_by_default() as default:
        assert default.active
        assert default.name == "attnkit"
        ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    assert default.applied == 1  # Qwen3ForCausalLM (its Qwen3Model shares the config)
    ours.load_state_dict(sdpa.state_dict())
    assert ours.config._attn_implementation == "attnkit"
    ids, mask = batch()
    with torch.no_grad(), attnkit.trace() as t:
        got = ours(ids, attention_mask=mask).logits
    assert len(t.backends) == 2  # one attnkit call per layer
    with torch.no_grad():
        want = sdpa(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[1], want[1], atol=ATOL_LOGITS, rtol=0)
    torch.testing.assert_close(got[0, 3:], want[0, 3:], atol=ATOL_LOGITS, rtol=0)


def test_from_pretrained_without_a_name_and_restore(tmp_path: object) -> None:
    path = str(tmp_path)
    transformers.AutoModelForCausalLM.from_config(tiny_config("gpt2")).save_pretrained(path)
    handle = use_by_default()
    try:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(path)
        assert loaded.config._attn_implementation == "attnkit"
    finally:
        handle.restore()
    assert not handle.active
    handle.restore()  # a second restore does nothing
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert reloaded.config._attn_implementation == "sdpa"


def test_a_name_the_caller_gives_is_kept() -> None:
    with use_by_default():
        for impl in ("eager", "sdpa"):
            model = transformers.AutoModelForCausalLM.from_config(
                tiny_config("qwen3"), attn_implementation=impl
            )
            assert model.config._attn_implementation == impl
        model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3"))
        model.set_attn_implementation("eager")
        assert model.config._attn_implementation == "eager"


def test_models_without_sdpa_or_without_the_interface_keep_transformers_choice() -> None:
    # Falcon supports sdpa but picks its attention classes from a table of its own (its layers
    # skip AttentionInterface: attnkit would never run), so its default stays sdpa; Bloom has
    # no sdpa, and transformers falls back to eager for it, with or without use_by_default
    falcon = transformers.FalconConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4
    )
    bloom = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
    auto = transformers.AutoModelForCausalLM
    with use_by_default() as default:
        assert auto.from_config(falcon).config._attn_implementation == "sdpa"
        assert auto.from_config(bloom).config._attn_implementation == "eager"
        assert default.applied == 0


def test_nested_handles_end_in_order() -> None:
    with use_by_default():
        with use_by_default():
            assert _default_impl() == "attnkit"
        assert _default_impl() == "attnkit"
    assert _default_impl() == "sdpa"


def test_ending_handles_out_of_order_is_refused() -> None:
    outer = use_by_default()
    inner = use_by_default()
    try:
        with pytest.raises(AttentionInputError) as e:
            outer.restore()
        message = str(e.value)
        assert "restore" in message
        assert "another use_by_default() made after this one" in message
        assert "fix:" in message
        assert "newer handle first" in message
        assert outer.active
    finally:
        inner.restore()
        outer.restore()
    assert _default_impl() == "sdpa"


def test_a_taken_name_is_refused() -> None:
    with pytest.raises(AttentionInputError) as e:
        use_by_default("sdpa")
    message = str(e.value)
    assert "name" in message
    assert "already has an implementation named 'sdpa'" in message
    assert _default_impl() == "sdpa"


def test_instead_of_eager_gives_attnkit_to_models_without_sdpa() -> None:
    # Gemma 2 has no sdpa (its soft-cap): transformers runs it on eager; attnkit computes it
    gemma = transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    auto = transformers.AutoModelForCausalLM
    with use_by_default():
        assert auto.from_config(copy.deepcopy(gemma)).config._attn_implementation == "eager"
    with use_by_default(instead_of=("sdpa", "eager")) as default:
        model = auto.from_config(copy.deepcopy(gemma))
        assert model.config._attn_implementation == "attnkit"
        assert default.instead_of == frozenset({"sdpa", "eager"})
        # Bloom's layers skip the interface: eager still
        bloom = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
        assert auto.from_config(bloom).config._attn_implementation == "eager"


@pytest.mark.parametrize("bad", [(), ("flex_attention",), "sdpa", ("sdpa", ["eager"])])
def test_instead_of_names_only_sdpa_and_eager(bad: object) -> None:
    with pytest.raises(AttentionInputError) as e:
        use_by_default(instead_of=bad)  # type: ignore[arg-type]
    message = str(e.value)
    assert "instead_of" in message
    assert f"got:      instead_of={bad!r}" in message
    assert 'a non-empty tuple of "sdpa" and "eager"' in message
    assert (
        'fix:      use_by_default() (sdpa only) or use_by_default(instead_of=("sdpa", "eager"))'
        in message
    )
    assert _default_impl() == "sdpa"
