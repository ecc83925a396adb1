"""One attention layer's call in a decode step, through ``attn_implementation="attnkit"`` and
``"sdpa"``: the rows of ``benchmarks/overhead.py`` that time the per-layer tax.

A tiny random Llama (2 layers, vocabulary 128; heads and head dim per case) runs a prompt of 63
tokens and one decode step on each implementation; a recording implementation keeps the exact
arguments the first layer passes in that step (q ``(B, H, 1, D)``, k/v ``(B, Hkv, 64, D)`` from
the ``DynamicCache``, the mask the model's mask function made, the keyword arguments). Then
:func:`attnkit.interop.hf_attention` and transformers' ``sdpa_attention_forward`` are timed on
their own arguments, interleaved. With ``B=2`` the first row is left-padded by 5 tokens:
attnkit's mask function hands the layers a spec (``causal() & key_mask``), sdpa's a dense
``(B, 1, 1, S)`` mask.

Dimension legend: B batch, H query heads, Hkv key/value heads, S cached keys, D head dim.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

#: name, (B, H, Hkv, D): the first layer's call in one decode step over 64 cached keys
HF_CASES = [
    ("HF layer, GQA 32/8 D=128 S=64", (1, 32, 8, 128)),
    ("HF layer, GQA 9/3 D=64 S=64", (1, 9, 3, 64)),
    ("HF layer, 9/3 D=64 S=64 B=2 padded", (2, 9, 3, 64)),
]

PROMPT = 64  # the decode step's query is token 64: S = 64 keys after it is cached


def layer_arguments(impl: str, sizes: tuple[int, int, int, int]) -> tuple[Any, ...]:
    """``(module, q, k, v, mask, kwargs)`` of the first layer's call in one decode step of a
    tiny random Llama on ``impl`` (``"attnkit"`` or ``"sdpa"``)."""
    import transformers
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import attnkit.interop

    attnkit.interop.register_hf()
    B, H, Hkv, D = sizes
    calls: list[tuple[Any, ...]] = []

    def recording(module: Any, q: Any, k: Any, v: Any, mask: Any, **kwargs: Any) -> Any:
        calls.append((module, q, k, v, mask, kwargs))
        return ALL_ATTENTION_FUNCTIONS[impl](module, q, k, v, mask, **kwargs)

    name = f"overhead_{impl}"
    ALL_ATTENTION_FUNCTIONS.register(name, recording)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=H * D, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=H, num_key_value_heads=Hkv, head_dim=D,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=name
    ).eval()
    ids = torch.randint(1, 128, (B, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, PROMPT, dtype=torch.long)
    if B > 1:
        mask[0, :5] = 0
    with torch.no_grad():
        out = model(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
        calls.clear()
        model(ids[:, -1:], attention_mask=mask, past_key_values=out.past_key_values)
    return calls[0]


def measure_hf(
    sizes: tuple[int, int, int, int],
    compare: Callable[
        [Callable[[], torch.Tensor], Callable[[], torch.Tensor], int], dict[str, float]
    ],
    reps: int,
) -> dict[str, float]:
    """hf_attention against sdpa_attention_forward on one decode step's layer call, through
    ``compare`` (overhead.py's interleaved medians), under ``torch.no_grad()``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from attnkit.interop.hf_attention import hf_attention

    m_a, q_a, k_a, v_a, mask_a, kw_a = layer_arguments("attnkit", sizes)
    m_s, q_s, k_s, v_s, mask_s, kw_s = layer_arguments("sdpa", sizes)

    def ours() -> torch.Tensor:
        return hf_attention(m_a, q_a, k_a, v_a, mask_a, **kw_a)[0]

    def theirs() -> torch.Tensor:
        return sdpa_attention_forward(m_s, q_s, k_s, v_s, mask_s, **kw_s)[0]

    with torch.no_grad():
        return compare(ours, theirs, reps)
