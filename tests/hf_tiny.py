"""Tiny random transformers models for the tests of ``attn_implementation="attnkit"``
(``tests/interop/test_hf_*.py``): an eager model and an attnkit model with one state dict, a
left-padded batch, a stand-in attention layer, and a recorder of the masks attnkit's mask
interface returns and its attention runs on.

Dimension legend: B batch, T tokens.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

# a missing optional package skips the test modules that import this one, never fails collection
transformers = pytest.importorskip("transformers")

ATOL_LOGITS = 1e-4
ATOL_WEIGHTS = 1e-5
VOCAB, B, T = 64, 2, 9
EAGER_FIX = 'fix:      load this model with attn_implementation="eager"'


def pair(config: Any, model_class: Any = None) -> tuple[Any, Any]:
    """(eager model, attnkit model) of ``model_class`` (default: ``AutoModelForCausalLM``'s
    class for ``config``) with the same random weights (std 0.3, so that attention matters), in
    eval mode."""
    models = []
    for impl in ("eager", "attnkit"):
        torch.manual_seed(0)
        if model_class is None:
            auto = transformers.AutoModelForCausalLM
            models.append(auto.from_config(copy.deepcopy(config), attn_implementation=impl))
        else:
            models.append(model_class._from_config(copy.deepcopy(config), attn_implementation=impl))
    ref, ours = models
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(std=0.3)
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == "attnkit"
    return ref.eval(), ours.eval()


def tiny_config(name: str) -> Any:
    """A tiny config of one of these model types (2 layers, 4 heads of 8, vocabulary 64)."""
    small = {"vocab_size": VOCAB, "pad_token_id": 0}
    gpt = {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
    llama_like = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2,
    }  # fmt: skip
    configs = {
        # these three drop output_attentions before their layers (their weights came back
        # as an empty tuple on attnkit): transformers' output capturing collects them
        "gpt2": lambda: transformers.GPT2Config(**small, **gpt),
        "gpt_bigcode": lambda: transformers.GPTBigCodeConfig(**small, **gpt, multi_query=True),
        "opt": lambda: transformers.OPTConfig(
            **small, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
            word_embed_proj_dim=32,
        ),
        "qwen3": lambda: transformers.Qwen3Config(**small, **llama_like, head_dim=8),
        "granite_swa": lambda: transformers.GraniteSWAConfig(
            **small, **llama_like, sliding_window=4,
            layer_types=["full_attention", "sliding_attention"],
        ),
    }  # fmt: skip
    return configs[name]()


def batch(length: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(B, length)`` and their mask with the first row left-padded by 3."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (B, length), generator=g)
    mask = torch.ones(B, length, dtype=torch.long)
    mask[0, :3] = 0
    ids[0, :3] = 0
    return ids, mask


class Layer(torch.nn.Module):
    """A stand-in attention layer (what hf_attention reads of it: is_causal, config)."""

    def __init__(self) -> None:
        super().__init__()
        self.is_causal = True


def record_masks(monkeypatch: pytest.MonkeyPatch) -> tuple[list[object], list[object]]:
    """(what attnkit.attention gets from hf_attention per layer, direct runs included; what
    attnkit's mask interface returned), recorded from now on."""
    import attnkit.interop.hf_attention as hfa

    mu = transformers.masking_utils
    seen: list[object] = []
    returned: list[object] = []
    real, real_direct = hfa.attention, hfa.memo.run_direct
    interface = mu.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    real_mask = interface["attnkit"]

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["mask"])
        return real(*args, **kwargs)

    def recording_direct(q: Any, k: Any, v: Any, mask: Any, *rest: Any) -> Any:
        out, key = real_direct(q, k, v, mask, *rest)
        if out is not None:
            seen.append(mask)
        return out, key

    def recording_mask(*args: Any, **kwargs: Any) -> Any:
        returned.append(real_mask(*args, **kwargs))
        return returned[-1]

    monkeypatch.setattr(hfa, "attention", recording)
    monkeypatch.setattr(hfa.memo, "run_direct", recording_direct)
    monkeypatch.setitem(interface, "attnkit", recording_mask)
    return seen, returned
