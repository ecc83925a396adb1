"""attnkit.KVCache(static=True): the whole buffers and a length rule, for compiled decoding.

The static cache must give what the dynamic cache gives (within the float64 oracle's rule, per
sequence of a ragged batch, GQA and MHA, fp64/fp32/bf16/fp16), and a decode step compiled with
``torch.compile(fullgraph=True)`` must run step after step without compiling again, which the
dynamic cache cannot do (its returned slice grows: shown here too). Compiling costs seconds on a
2-core CPU: the cases are tiny and run through the ``eager`` backend (Dynamo alone, what decides
whether a step recompiles), one through ``aot_eager``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import attnkit
from attnkit import AttentionInputError, KVCache
from attnkit.masks import causal
from attnkit.models import GPT, GPTConfig
from attnkit.modules import TransformerConfig, TransformerStack
from attnkit.modules.positions import RotaryEmbedding, alibi
from oracle import reference_attention, within_naive

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method`:DeprecationWarning")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Each test counts its own graphs (Dynamo's caches live on shared code objects)."""
    torch._dynamo.reset()


def _fill(cache: KVCache, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> None:
    """Write right-padded ``k, v (B, Hkv, T, D)`` and keep each sequence's ``lengths``."""
    cache.update(0, k, v)
    cache.truncate(torch.tensor(lengths))


def test_static_update_returns_the_buffers_and_a_length_rule() -> None:
    cache = KVCache(2, 3, max_len=10, head_dim=4, v_head_dim=5, static=True)
    assert "static=True" in repr(cache)
    k1, v1 = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 5)
    k_all, v_all = cache.update(0, k1, v1)
    assert k_all.shape == (2, 3, 10, 4)
    assert v_all.shape == (2, 3, 10, 5)
    assert k_all.data_ptr() == cache.k.data_ptr()  # the buffers themselves, no copy
    assert torch.equal(k_all[:, :, :4], k1)
    assert torch.equal(v_all[:, :, :4], v1)
    pos = cache.next_pos()
    assert isinstance(pos, torch.Tensor)
    assert pos.tolist() == [4, 4]
    rule = cache.rule(1)
    assert rule is not None  # always a spec: the buffer's empty rest must be masked
    assert rule.to_dense(1, 10)[:, 0, 0].tolist() == [[True] * 4 + [False] * 6] * 2
    cache.truncate(torch.tensor([4, 2]))
    k2, v2 = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 5)
    cache.update(cache.next_pos(), k2, v2)  # each sequence at its own length
    assert cache.lengths.tolist() == [6, 4]
    assert torch.equal(cache.k[0, :, 4:6], k2[0])
    assert torch.equal(cache.k[1, :, 2:4], k2[1])
    dense = cache.rule(2).to_dense(2, 10)[:, 0]  # (B, L, N)
    for b, n in enumerate([6, 4]):
        assert torch.equal(dense[b, :, :n], attnkit.causal_mask(2, n))
        assert not dense[b, :, n:].any()
    no_causal = cache.rule(2, causal=False)
    assert no_causal is not None
    assert no_causal.to_dense(2, 10)[1, 0].sum(dim=-1).tolist() == [4, 4]
    cache.update(1, k2, v2)  # rewinding overwrites, as in the dynamic cache
    assert cache.lengths.tolist() == [3, 3]
    cache.reset()
    assert cache.next_pos().tolist() == [0, 0]


def _keys(B: int, Hkv: int, T: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, Hkv, T, 16, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)], ids=["gqa", "mha"])
def test_static_attention_is_the_oracle_per_sequence(
    dtype: torch.dtype, heads: tuple[int, int]
) -> None:
    """A ragged batch (lengths 7, 3, 5) then 2 new tokens and 1: the static cache's output
    against its whole buffer and rule equals, per sequence, the float64 oracle of that
    sequence alone, and the dynamic cache's output."""
    H, Hkv = heads
    B, lengths = 3, [7, 3, 5]
    static = KVCache(B, Hkv, max_len=12, head_dim=16, dtype=dtype, static=True)
    dynamic = KVCache(B, Hkv, max_len=12, head_dim=16, dtype=dtype)
    k0, v0 = _keys(B, Hkv, 7, 0, dtype), _keys(B, Hkv, 7, 1, dtype)
    for cache in (static, dynamic):
        _fill(cache, k0, v0, lengths)
    seqs = [(k0[b, :, :n], v0[b, :, :n]) for b, n in enumerate(lengths)]  # (Hkv, n, D) each
    for step, T in enumerate([2, 1]):
        q = _keys(B, H, T, 10 + step, dtype)
        k, v = _keys(B, Hkv, T, 20 + step, dtype), _keys(B, Hkv, T, 30 + step, dtype)
        outs = []
        for cache in (static, dynamic):
            k_all, v_all = cache.update(cache.next_pos(), k, v)
            outs.append(attnkit.attention(q, k_all, v_all, mask=cache.rule(T), causal=True))
        assert static.k.shape[2] == 12  # the static cache always hands over the whole buffer
        seqs = [(torch.cat([ks, k[b]], 1), torch.cat([vs, v[b]], 1)) for b, (ks, vs) in
                enumerate(seqs)]  # fmt: skip
        for b, (ks, vs) in enumerate(seqs):
            args = (q[b : b + 1], ks[None], vs[None])
            want, _ = reference_attention(*args, causal=True)
            naive, _ = reference_attention(*args, causal=True, dtype=dtype)
            for got, name in zip(outs, ("static", "dynamic"), strict=True):
                within_naive(got[b : b + 1], want, naive, what=f"{name} seq {b} T={T}")
        if dtype == torch.float64:
            torch.testing.assert_close(outs[0], outs[1], atol=1e-12, rtol=0)


def test_a_static_cache_in_a_rope_module_equals_the_dynamic_cache() -> None:
    """MultiHeadAttention with RoPE and GQA decodes a ragged batch with a static cache as
    with the dynamic one (the positions come from the lengths tensor)."""
    torch.manual_seed(3)
    rope = RotaryEmbedding(8)
    mha = attnkit.MultiHeadAttention(48, 6, num_kv_heads=2, causal=True, rope=rope).eval()
    mha = mha.double()
    x0, steps = torch.randn(3, 6, 48).double(), torch.randn(3, 4, 48).double()
    outs = []
    for static in (True, False):
        cache = KVCache(3, 2, max_len=10, head_dim=8, dtype=torch.float64, static=static)
        with torch.no_grad():
            mha(x0, kv_cache=cache)
            cache.truncate(torch.tensor([6, 2, 4]))
            outs.append(torch.cat([mha(steps[:, i : i + 1], kv_cache=cache).output
                                   for i in range(4)], dim=1))  # fmt: skip
    torch.testing.assert_close(outs[0], outs[1], atol=1e-12, rtol=0)


def test_a_module_mask_with_a_static_cache_is_refused() -> None:
    """The buffer's end is not each sequence's: an end-aligned user rule (here ALiBi &
    causal, whose distances would be counted from the buffer's end) is refused, not run."""
    stack = TransformerStack(TransformerConfig(dim=32, num_heads=4, norm_first=True), 2).eval()
    cache = [KVCache(2, 4, max_len=11, head_dim=8, static=True) for _ in range(2)]
    with pytest.raises(AttentionInputError, match="static KV cache attends over its whole") as e:
        stack(torch.randn(2, 5, 32), mask=alibi(4) & causal(), kv_cache=cache)
    assert "static=False" in str(e.value)
    assert "max_len=11" in str(e.value)
    assert cache[0].lengths.tolist() == [0, 0]  # nothing was written


def _layer(
    static: bool, lengths: tuple[int, int], dtype: torch.dtype
) -> tuple[attnkit.MultiHeadAttention, KVCache]:
    """A GQA decoder layer's attention and a cache holding ``lengths`` of its prefill."""
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, dtype=dtype).eval()
    cache = KVCache(2, 2, max_len=16, head_dim=8, static=static, dtype=dtype)
    with torch.no_grad():
        mha(torch.randn(2, 5, 32, dtype=dtype), kv_cache=cache)
    cache.truncate(torch.tensor(lengths))
    return mha, cache


def _decoder(
    static: bool, lengths: tuple[int, int] = (5, 3), dtype: torch.dtype = torch.float32
) -> tuple[Callable[[torch.Tensor], torch.Tensor], KVCache]:
    """A GQA decoder layer's attention with a cache holding ``lengths`` and its step."""
    mha, cache = _layer(static, lengths, dtype)

    def step(x: torch.Tensor) -> torch.Tensor:
        return mha(x, kv_cache=cache).output

    return step, cache


def test_a_compiled_decode_step_with_a_static_cache_does_not_recompile() -> None:
    """Six steps, one graph; outputs equal the same steps run eagerly on a dynamic cache."""
    step, cache = _decoder(static=True)
    eager_step, _ = _decoder(static=False)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    xs = torch.randn(6, 2, 1, 32)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for x in xs:
            torch.testing.assert_close(compiled(x), eager_step(x), atol=1e-6, rtol=1e-6)
    assert counter.frame_count == 1
    assert cache.lengths.tolist() == [11, 9]  # the compiled graph moved the lengths on


def _kernel_gap(mha: attnkit.MultiHeadAttention, vmax: float, y: torch.Tensor) -> torch.Tensor:
    """How far two correct low-precision kernels' layer outputs ``y`` may lie apart, per
    element, when the same q, k, v reach both (the projections are the same torch ops on the
    same inputs on both sides; only the attention kernel differs).

    With u the dtype's unit roundoff (eps / 2): each kernel's attention output ``a`` is rounded
    once (u |a| each, |a| <= max |v|, a convex combination of value rows), and a kernel that
    rounds the softmax weights P to the dtype for its P·V products (attnkit's bf16 dot-product
    build, SDPA's low-precision kernels) adds at most u max |v| (the weights sum to 1); the
    float32 arithmetic inside is far below u. So |a1 - a2| <= 3u max |v|. The output projection
    (one bf16/fp16 linear with float32 accumulation, the same kernel on both sides) maps that to
    at most ||W_o[i]||_1 3u max |v| in output ``i``, and rounds ``y`` once on each side (2u |y|).
    """
    u = torch.finfo(y.dtype).eps / 2
    w = mha.out_proj.weight.detach().float().abs().sum(dim=1)  # ||W_o[i]||_1, (E,)
    return w * 3 * u * vmax + 2 * u * y.detach().float().abs()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_compiled_low_precision_decode_step_does_not_recompile(dtype: torch.dtype) -> None:
    """bf16/fp16 K/V in the cache: five steps, one graph, within the bound of
    :func:`_kernel_gap` of the eager static step's outputs. Not bitwise: eager runs a decode
    step on the decode kernel (float32 weights) or SDPA, as auto's rule for this CPU says, and
    the compiled graph on the row-span kernel (on an AVX512-BF16 CPU, bf16 dot products with the
    weights rounded to bf16), so the two round differently."""
    step, _ = _decoder(static=True, dtype=dtype)
    mha, cache = _layer(True, (5, 3), dtype)

    def eager_step(x: torch.Tensor) -> torch.Tensor:
        return mha(x, kv_cache=cache).output

    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    xs = torch.randn(5, 2, 1, 32, dtype=dtype)
    with torch.no_grad():
        for x in xs:
            got, want = compiled(x), eager_step(x)
            gap = (got.float() - want.float()).abs()
            vmax = cache.v.abs().max().item()  # every value row either step reads, and more
            bound = _kernel_gap(mha, vmax, want)
            assert bool((gap <= bound).all()), f"{gap.max()} > {bound.min()}"
    assert counter.frame_count == 1


def test_the_dynamic_cache_recompiles_at_every_step() -> None:
    """The same check fails on the dynamic cache: its second step already compiles again
    (with equal lengths; a ragged batch's per-sequence positions are not traced at all)."""
    step, _ = _decoder(static=False, lengths=(5, 5))
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    xs = torch.randn(2, 2, 1, 32)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        compiled(xs[0])
        with pytest.raises(torch._dynamo.exc.RecompileError):
            compiled(xs[1])


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=97, max_positions=64, dim=32, num_layers=2, num_heads=4)
    model = GPT(cfg).eval()
    for p in model.parameters():  # larger weights than GPT-2's init: a sharper test
        p.data.normal_(0, 0.2)
    return model


def test_compiled_generate_gives_the_eager_tokens_and_compiles_once() -> None:
    """Left- and right-padded prompts of three lengths: compiled greedy tokens equal the
    eager (dynamic-cache) ones; a second call with new prompts of the same shape compiles
    nothing more."""
    model = _gpt()
    ids = torch.randint(1, 97, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, :2] = False  # left padding
    mask[2, 4:] = False  # right padding
    counter = CompileCounterWithBackend("eager")
    want = model.generate(ids, 7, attention_mask=mask)
    assert torch.equal(model.generate(ids, 7, attention_mask=mask, compile=counter), want)
    assert counter.frame_count == 1
    assert torch.equal(model.generate(ids, 7, attention_mask=mask, static_cache=True), want)
    other = torch.randint(1, 97, (3, 6))
    got = model.generate(other, 7, attention_mask=mask, compile=counter)
    assert torch.equal(got, model.generate(other, 7, attention_mask=mask))
    assert counter.frame_count == 1


def test_static_cache_errors_read() -> None:
    cache = KVCache(2, 2, max_len=6, head_dim=4, static=True)
    cache.update(0, torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4))
    with pytest.raises(AttentionInputError, match=r"overflow the cache: 7 > max_len=6") as e:
        cache.update(cache.next_pos(), torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4))
    assert "max_len >= 7" in str(e.value)
    assert cache.lengths.tolist() == [5, 5]  # nothing was written
    with pytest.raises(AttentionInputError, match="another dtype") as e:
        cache.update(cache.next_pos(), *[torch.randn(2, 2, 1, 4).half()] * 2)
    assert "cache torch.float32" in str(e.value)
    cache.truncate(torch.tensor([3, 5]))
    with pytest.raises(AttentionInputError, match="gap") as e:
        cache.update(torch.tensor([4, 5]), torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    assert "cached lengths=[3, 5]" in str(e.value)
    with pytest.raises(AttentionInputError, match="one integer start position per sequence"):
        cache.update(torch.tensor([3.0, 5.0]), torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    with pytest.raises(AttentionInputError, match="only be shortened"):
        cache.truncate(torch.tensor([3, 6]))
    with pytest.raises(AttentionInputError, match="`static` must be True or False"):
        KVCache(1, 2, max_len=4, head_dim=4, static="yes")  # type: ignore[arg-type]


def test_writing_past_max_len_in_a_compiled_step_raises_with_the_same_words() -> None:
    """Inside a graph the values cannot be read: an assert in the graph stops the write."""
    cache = KVCache(1, 1, max_len=3, head_dim=4, static=True)

    def write(k: torch.Tensor) -> torch.Tensor:
        return cache.update(cache.next_pos(), k, k)[0]

    compiled = torch.compile(write, fullgraph=True, backend="eager")
    for _ in range(3):
        compiled(torch.randn(1, 1, 1, 4))
    with pytest.raises(RuntimeError, match=r"`pos` out of range.*pos \+ T <= max_len"):
        compiled(torch.randn(1, 1, 1, 4))
    assert cache.lengths.tolist() == [3]


def test_generate_compile_arguments_are_checked() -> None:
    model = _gpt()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(AttentionInputError, match="needs the static KV cache") as e:
        model.generate(ids, 2, compile="eager", static_cache=False)
    assert "recompile" in str(e.value)
    with pytest.raises(AttentionInputError, match="use_cache=False would grow"):
        model.generate(ids, 2, compile=True, use_cache=False)
    with pytest.raises(AttentionInputError, match="`compile` must be a bool or"):
        model.generate(ids, 2, compile=1)  # type: ignore[arg-type]
    with pytest.raises(AttentionInputError, match="`static_cache` must be None"):
        model.generate(ids, 2, static_cache="static")  # type: ignore[arg-type]
    with pytest.raises(AttentionInputError, match="use_cache=False uses none"):
        model.generate(ids, 2, static_cache=True, use_cache=False)


def test_owned_specs_coming_and_going_do_not_recompile_a_decode_step() -> None:
    """Each forward of a transformers model on attnkit owns a spec of its own
    (:mod:`attnkit.backends.owned`) that is freed after it: a compiled step elsewhere in the
    process must not guard on how many there are (it did, and recompiled as they were freed)."""
    from attnkit.backends import owned
    from attnkit.masks import key_mask

    step, _ = _decoder(static=True, dtype=torch.bfloat16)
    compiled = torch.compile(step, fullgraph=True, backend=CompileCounterWithBackend("eager"))
    held = [owned.own(causal() & key_mask(torch.ones(1, 4, dtype=torch.bool))) for _ in range(3)]
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(4):
            compiled(torch.randn(2, 1, 32, dtype=torch.bfloat16))
            held.pop() if i % 2 else held.append(owned.own(causal() & causal()))
