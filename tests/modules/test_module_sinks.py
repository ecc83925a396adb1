"""Attention sinks in the modules: learned per head (``sinks=True``, gpt-oss) or passed per call
(``(H,)``, ``(B, H, L)``, ``(1, H, L)``), against a float64 reference written here by hand
(projections, one softmax per head with the sink column, merge, output projection), forward
and the gradients of the sinks and the projections; grouped-query heads, causal, key padding,
KV-cache decoding (dynamic and static), the transformer layer and GPT, and transformers'
gpt-oss attention layer with the same weights.

Tolerances: float64 to 1e-10 relative to the largest value (the module and the reference
differ only in summation order); float32 by the oracle's rule (tests/oracle.py: twice the error
of the reference run in float32, plus its floor).

Dimension legend: B batch, L query length, S key length, E model width, H query heads, Hkv
key/value heads, D head dim.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import KVCache, MultiHeadAttention
from attnkit.models import GPT, GPTConfig
from attnkit.modules import CrossAttention, SelfAttention, TransformerConfig, TransformerLayer
from attnkit.modules.sinks import SINKS_INIT_STD
from oracle import within_naive

F64 = torch.float64


def _reference(
    m: MultiHeadAttention,
    x: torch.Tensor,
    sinks: torch.Tensor | None,
    *,
    context: torch.Tensor | None = None,
    real: torch.Tensor | None = None,
    dtype: torch.dtype = F64,
) -> torch.Tensor:
    """The module's output written out in ``dtype``: ``x (B, L, E)``, keys from ``context``
    (default ``x``); ``real (B, S)`` True = a real key; ``sinks`` ``(H,)`` or ``(B|1, H, L)``.
    Differentiable in the module's parameters (taken as they are, cast to ``dtype``)."""
    ctx = x if context is None else context
    B, L, _ = x.shape
    S = ctx.shape[1]
    H, Hkv, D, Dv = m.num_heads, m.num_kv_heads, m.head_dim, m.v_head_dim

    def proj(layer: torch.nn.Module, t: torch.Tensor) -> torch.Tensor:
        y = t.to(dtype) @ layer.weight.to(dtype).T
        return y if layer.bias is None else y + layer.bias.to(dtype)

    q = proj(m.q_proj, x).view(B, L, H, D)
    k = proj(m.k_proj, ctx).view(B, S, Hkv, D)
    v = proj(m.v_proj, ctx).view(B, S, Hkv, Dv)
    heads = []
    for b in range(B):
        per_head = []
        for h in range(H):
            hk = h // (H // Hkv)
            scores = q[b, :, h] @ k[b, :, hk].T / math.sqrt(D)  # (L, S)
            allowed = torch.ones(L, S, dtype=torch.bool)
            if m.causal:  # end-aligned: query i sees keys j <= i + S - L
                allowed &= torch.arange(S)[None, :] <= torch.arange(L)[:, None] + (S - L)
            if real is not None:
                allowed &= real[b][None, :]
            scores = scores.masked_fill(~allowed, -math.inf)
            if sinks is None:
                column = torch.full((L, 1), -math.inf, dtype=dtype)
            elif sinks.dim() == 1:
                column = sinks[h].to(dtype).expand(L, 1)
            else:
                column = sinks[min(b, sinks.shape[0] - 1), h].to(dtype).unsqueeze(1)
            weights = torch.softmax(torch.cat([scores, column], dim=1), dim=1)[:, :S]
            weights = torch.nan_to_num(weights)  # no sink and no key: a row of 0
            per_head.append(weights @ v[b, :, hk])  # (L, Dv)
        heads.append(torch.cat(per_head, dim=1))  # (L, H*Dv)
    merged = torch.stack(heads)  # (B, L, H*Dv)
    out = m.out_proj
    if isinstance(out, torch.nn.Linear):
        return proj(out, merged)
    return merged


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item() / max(1.0, want.abs().max().item())


@st.composite
def _cases(draw: st.DrawFn) -> dict[str, object]:
    Hkv = draw(st.sampled_from([1, 2]))
    H = Hkv * draw(st.sampled_from([1, 2, 3]))
    B, L = draw(st.integers(1, 3)), draw(st.integers(1, 7))
    return {
        "B": B,
        "L": L,
        "H": H,
        "Hkv": Hkv,
        "D": draw(st.integers(1, 5)),
        "causal": draw(st.booleans()),
        "sinks": draw(st.sampled_from(["learned", "(H,)", "(B, H, L)", "(1, H, L)"])),
        "lengths": draw(st.lists(st.integers(0, L), min_size=B, max_size=B)),
        "backend": draw(st.sampled_from(["auto", "math", "blocked"])),
        "seed": draw(st.integers(0, 2**16)),
    }


@pytest.mark.filterwarnings("ignore::attnkit.errors.AttentionMaskWarning")  # a sequence of no key
@settings(max_examples=40)
@given(case=_cases())
def test_module_sinks_match_the_hand_written_reference(case: dict) -> None:
    """Learned and per-call sinks of every shape, grouped-query heads, causal, key padding
    (a sequence may have no key at all: its rows are the sink's alone, output 0 before the
    projection), every backend: the output and the gradients of the sinks and of q_proj."""
    B, L, H, Hkv, D = (case[n] for n in ("B", "L", "H", "Hkv", "D"))
    torch.manual_seed(case["seed"])
    learned = case["sinks"] == "learned"
    m = MultiHeadAttention(
        H * D, H, num_kv_heads=Hkv, causal=case["causal"], backend=case["backend"],
        sinks=learned, dtype=F64,
    )  # fmt: skip
    x = torch.randn(B, L, H * D, dtype=F64)
    real = torch.arange(L)[None, :] < torch.tensor(case["lengths"])[:, None]  # (B, S)
    shape = {"(H,)": (H,), "(B, H, L)": (B, H, L), "(1, H, L)": (1, H, L)}.get(case["sinks"])
    given_sinks = None if shape is None else (torch.randn(shape, dtype=F64) * 2).requires_grad_()
    out = m(x, attention_mask=real, sinks=given_sinks).output
    sinks = m.sinks if learned else given_sinks
    assert sinks is not None
    want = _reference(m, x, sinks, real=real)
    assert _rel_err(out, want) <= 1e-10
    w = torch.randn(out.shape, dtype=F64)
    got = torch.autograd.grad((out * w).sum(), (sinks, m.q_proj.weight))
    ref = torch.autograd.grad((want * w).sum(), (sinks, m.q_proj.weight))
    assert got[0].shape == sinks.shape
    for a, b in zip(got, ref, strict=True):
        assert _rel_err(a, b) <= 1e-10


def test_float32_module_sinks_within_the_oracle_rule() -> None:
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 8, num_kv_heads=2, causal=True, sinks=True)
    with torch.no_grad():
        m.sinks.copy_(torch.linspace(-3, 3, 8))  # from "never taken" to "takes most weight"
    x = torch.randn(2, 13, 32)
    out = m(x).output
    want = _reference(m, x, m.sinks)
    within_naive(out, want, _reference(m, x, m.sinks, dtype=torch.float32), what="float32")
    w = torch.randn(out.shape)
    got = torch.autograd.grad((out * w).sum(), m.sinks)[0]
    ref = torch.autograd.grad((want * w.double()).sum(), m.sinks)[0]
    naive = torch.autograd.grad((_reference(m, x, m.sinks, dtype=torch.float32) * w).sum(), m.sinks)
    within_naive(got, ref, naive[0], grad=True, what="dsinks")


def test_learned_sinks_are_a_parameter_named_as_in_gpt_oss() -> None:
    """``sinks (H,)`` beside the projections; ``attn.sinks`` in a layer, as ``self_attn.sinks``
    in transformers' gpt-oss; normal(0, 0.02) as gpt-oss initialises them; none by default."""
    torch.manual_seed(0)
    m = MultiHeadAttention(4096, 4096, head_dim=1, sinks=True)
    assert isinstance(m.sinks, torch.nn.Parameter)
    assert m.sinks.shape == (4096,)
    assert "sinks" in dict(m.named_parameters())
    assert abs(m.sinks.std().item() - SINKS_INIT_STD) < 0.1 * SINKS_INIT_STD
    assert abs(m.sinks.mean().item()) < 5 * SINKS_INIT_STD / math.sqrt(4096)
    assert "sinks=True" in repr(m)
    plain = MultiHeadAttention(16, 4)
    assert plain.sinks is None
    assert "sinks" not in plain.state_dict()
    layer = TransformerLayer(TransformerConfig(dim=16, num_heads=4, attention_sinks=True))
    assert layer.state_dict()["attn.sinks"].shape == (4,)
    gpt = GPT(GPTConfig(vocab_size=10, max_positions=8, dim=16, num_layers=2, num_heads=4,
                        attention_sinks=True))  # fmt: skip
    assert {n for n in gpt.state_dict() if n.endswith("sinks")} == {
        "stack.layers.0.attn.sinks",
        "stack.layers.1.attn.sinks",
    }
    loaded = MultiHeadAttention(16, 4, sinks=True)
    loaded.load_state_dict(layer.attn.state_dict())
    assert torch.equal(loaded.sinks, layer.attn.sinks)


def test_single_head_and_cross_attention_take_sinks() -> None:
    torch.manual_seed(1)
    x, ctx = torch.randn(2, 5, 8, dtype=F64), torch.randn(2, 7, 8, dtype=F64)
    one = SelfAttention(8, 3, sinks=True, causal=True, dtype=F64)
    assert one.sinks is not None
    assert one.sinks.shape == (1,)
    assert _rel_err(one(x).output, _reference(one, x, one.sinks)) <= 1e-10
    cross = CrossAttention(8, 2, sinks=True, dtype=F64)
    assert cross.sinks is not None
    got = cross(x, ctx).output
    assert _rel_err(got, _reference(cross, x, cross.sinks, context=ctx)) <= 1e-10
    per_token = torch.randn(2, 2, 5, dtype=F64)
    plain = CrossAttention(8, 2, dtype=F64)
    got = plain(x, ctx, sinks=per_token).output
    assert _rel_err(got, _reference(plain, x, per_token, context=ctx)) <= 1e-10


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("kind", ["learned", "per-token"])
def test_decoding_with_a_kv_cache_equals_the_full_forward(static: bool, kind: str) -> None:
    """The prompt, then one token at a time: each step's rows take their own sinks (the new
    tokens' rows of per-token sinks), and the steps together are the full forward."""
    torch.manual_seed(2)
    B, T, H, Hkv, D = 2, 7, 4, 2, 3
    m = MultiHeadAttention(H * D, H, num_kv_heads=Hkv, causal=True, dtype=F64,
                           sinks=kind == "learned")  # fmt: skip
    x = torch.randn(B, T, H * D, dtype=F64)
    per_token = torch.randn(B, H, T, dtype=F64) if kind == "per-token" else None
    sinks = m.sinks if per_token is None else per_token
    assert sinks is not None

    def rows(a: int, b: int) -> torch.Tensor | None:
        return None if per_token is None else per_token[:, :, a:b]

    cache = KVCache(B, Hkv, T + 1, D, dtype=F64, static=static)
    with torch.no_grad():
        full = m(x, sinks=per_token).output
        steps = [m(x[:, :4], kv_cache=cache, sinks=rows(0, 4)).output]
        steps += [m(x[:, t : t + 1], kv_cache=cache, sinks=rows(t, t + 1)).output
                  for t in range(4, T)]  # fmt: skip
        want = _reference(m, x, sinks)
    assert _rel_err(torch.cat(steps, dim=1), full) <= 1e-10
    assert _rel_err(full, want) <= 1e-10


def test_a_gpt_with_sinks_decodes_as_its_full_forward() -> None:
    torch.manual_seed(3)
    config = GPTConfig(vocab_size=50, max_positions=32, dim=32, num_layers=2, num_heads=4,
                       attention_sinks=True)  # fmt: skip
    model = GPT(config).eval()
    with torch.no_grad():
        for layer in model.stack.layers:
            layer.attn.sinks.normal_(std=2.0)  # far from 0, so they matter
    ids = torch.randint(0, 50, (2, 9))
    cache = model.new_cache(batch_size=2, max_len=12)
    with torch.no_grad():
        full = model(ids)
        steps = [model(ids[:, :5], kv_cache=cache)]
        steps += [model(ids[:, t : t + 1], kv_cache=cache) for t in range(5, 9)]
        plain = GPT(GPTConfig(**{**config.__dict__, "attention_sinks": False})).eval()
        plain.load_state_dict(model.state_dict(), strict=False)
        without = plain(ids)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert (full - without).abs().max() > 1e-2  # the sinks change the logits
    prompts = ids[:, :4]
    tokens = model.generate(prompts, 5)
    assert torch.equal(tokens, model.generate(prompts, 5, use_cache=False))
    assert torch.equal(tokens, model.generate(prompts, 5, static_cache=True))


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method`:DeprecationWarning")
def test_a_gpt_with_sinks_generates_the_same_tokens_compiled() -> None:
    """The decode step compiled over a static cache (aot_eager: Dynamo and AOT autograd) takes
    the learned sinks as it takes the other parameters."""
    torch._dynamo.reset()  # this test's graphs only (Dynamo's caches live on code objects)
    torch.manual_seed(7)
    config = GPTConfig(vocab_size=50, max_positions=32, dim=32, num_layers=2, num_heads=4,
                       attention_sinks=True)  # fmt: skip
    model = GPT(config).eval()
    with torch.no_grad():
        for layer in model.stack.layers:
            layer.attn.sinks.normal_(std=2.0)
    prompts = torch.randint(0, 50, (2, 4))
    tokens = model.generate(prompts, 5)
    assert torch.equal(tokens, model.generate(prompts, 5, compile="aot_eager"))


def test_gpt_oss_attention_layer_gives_what_the_module_gives() -> None:
    """transformers' GptOssAttention (eager, with its sinks) and a MultiHeadAttention with the
    same weights, RoPE left out (cos = 1, sin = 0) and the causal mask."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss

    torch.manual_seed(4)
    B, L, E, H, Hkv, D = 2, 6, 16, 4, 2, 8
    config = transformers.GptOssConfig(
        hidden_size=E, num_attention_heads=H, num_key_value_heads=Hkv, head_dim=D,
        num_hidden_layers=1, layer_types=["full_attention"], attention_bias=True,
    )  # fmt: skip
    config._attn_implementation = "eager"
    theirs = gpt_oss.GptOssAttention(config, layer_idx=0).double().eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(std=0.5)
    ours = MultiHeadAttention(E, H, num_kv_heads=Hkv, head_dim=D, causal=True, sinks=True,
                              dtype=F64)  # fmt: skip
    renamed = {n.replace("o_proj", "out_proj"): p for n, p in theirs.state_dict().items()}
    ours.load_state_dict(renamed)
    x = torch.randn(B, L, E, dtype=F64)
    cos, sin = torch.ones(B, L, D // 2, dtype=F64), torch.zeros(B, L, D // 2, dtype=F64)
    future = torch.ones(L, L, dtype=torch.bool).triu(1)
    additive = torch.zeros(B, 1, L, L, dtype=F64).masked_fill(future, -math.inf)
    with torch.no_grad():
        want, _ = theirs(x, (cos, sin), additive)
        got = ours(x).output
    assert _rel_err(got, want) <= 1e-12


def test_autocast_casts_the_learned_sinks_as_it_casts_the_projections() -> None:
    torch.manual_seed(5)
    m = MultiHeadAttention(16, 4, causal=True, sinks=True)
    x = torch.randn(2, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x).output
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert m.sinks.grad is not None
    assert m.sinks.grad.dtype == torch.float32
    assert _rel_err(out, _reference(m, x, m.sinks)) <= 2**-4
