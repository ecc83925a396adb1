"""attnkit.KVCache: buffers, positions, errors; incremental decoding equals the full forward.

Everything here runs in float32 and compares the logits (or outputs) of decoding with a cache,
token by token and in chunks, with one forward over the whole sequence: within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import AttentionInputError, KVCache
from attnkit.masks import causal
from attnkit.models import GPT, GPTConfig
from attnkit.modules import TransformerConfig, TransformerStack
from attnkit.modules.positions import RotaryEmbedding, alibi

ATOL = 1e-5


def test_update_writes_and_returns_everything_cached() -> None:
    cache = KVCache(2, 3, max_len=10, head_dim=4, v_head_dim=5)
    assert cache.k.shape == (2, 3, 10, 4)
    assert cache.v.shape == (2, 3, 10, 5)
    assert cache.next_pos() == 0
    k1, v1 = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 5)
    k_all, v_all = cache.update(0, k1, v1)
    assert torch.equal(k_all, k1)
    assert torch.equal(v_all, v1)
    k2, v2 = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 5)
    k_all, v_all = cache.update(cache.next_pos(), k2, v2)
    assert k_all.shape == (2, 3, 5, 4)
    assert v_all.shape == (2, 3, 5, 5)
    assert torch.equal(k_all, torch.cat([k1, k2], dim=2))
    assert torch.equal(v_all, torch.cat([v1, v2], dim=2))
    assert cache.next_pos() == 5
    assert cache.lengths.tolist() == [5, 5]
    assert cache.rule(1) is None  # same length everywhere: plain causal=True is exact
    assert dict(cache.state_dict()) == {}  # buffers are not weights
    cache.update(2, k2, v2)  # rewinding overwrites
    assert cache.next_pos() == 3


def test_overflow_is_a_clear_error() -> None:
    cache = KVCache(1, 2, max_len=6, head_dim=4)
    cache.update(0, torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
    with pytest.raises(AttentionInputError, match=r"overflow the cache: 7 > max_len=6") as e:
        cache.update(5, torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    assert "max_len >= 7" in str(e.value)
    assert "reset()" in str(e.value)
    assert cache.next_pos() == 5  # nothing was written


def test_bad_updates_say_what_is_wrong() -> None:
    cache = KVCache(2, 2, max_len=8, head_dim=4)
    with pytest.raises(AttentionInputError, match="do not fit the cache") as e:
        cache.update(0, torch.randn(2, 4, 1, 4), torch.randn(2, 4, 1, 4))
    assert "k (B=2, Hkv=4, T=1, D=4)" in str(e.value)
    with pytest.raises(AttentionInputError, match="another dtype"):
        cache.update(0, torch.randn(2, 2, 1, 4).double(), torch.randn(2, 2, 1, 4).double())
    with pytest.raises(AttentionInputError, match="gap"):
        cache.update(3, torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    with pytest.raises(AttentionInputError, match="one integer start position per sequence"):
        cache.update(torch.tensor([0, 0, 0]), torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    with pytest.raises(AttentionInputError, match="positive int"):
        KVCache(1, 2, max_len=0, head_dim=4)


def test_ragged_batch_keeps_per_sequence_lengths() -> None:
    cache = KVCache(3, 1, max_len=8, head_dim=2)
    first = torch.randn(3, 1, 4, 2)
    cache.update(0, first, first)
    cache.truncate(torch.tensor([4, 2, 3]))  # right-padded prompts: keep the real tokens
    pos = cache.next_pos()
    assert isinstance(pos, torch.Tensor)
    assert pos.tolist() == [4, 2, 3]
    new = torch.randn(3, 1, 2, 2)
    k_all, _ = cache.update(pos, new, new)
    assert cache.lengths.tolist() == [6, 4, 5]
    assert k_all.shape == (3, 1, 6, 2)
    for b, n in enumerate([4, 2, 3]):
        assert torch.equal(k_all[b, :, :n], first[b, :, :n])
        assert torch.equal(k_all[b, :, n : n + 2], new[b])
    # the rule for the 2 new queries: each sequence's own end-aligned causal rule
    rule = cache.rule(2)
    assert rule is not None
    dense = rule.to_dense(2, 6)[:, 0]  # (B, L, S)
    for b, n in enumerate([6, 4, 5]):
        expected = attnkit.causal_mask(2, n)  # the sequence alone: L = 2, S = n
        assert torch.equal(dense[b, :, :n], expected)
        assert not dense[b, :, n:].any()
    block = rule.block_map(2, 6, 1, 2).state  # per block, as a block-sparse backend sees it
    assert block.shape == (3, 1, 2, 3)
    assert block[1, 0, :, 2].tolist() == [0, 0]  # keys 4, 5 are past sequence 1's end
    no_causal = cache.rule(2, causal=False)
    assert no_causal is not None
    assert not no_causal.to_dense(2, 6)[1, 0, :, 4:].any()


def test_reset_and_truncate() -> None:
    cache = KVCache(2, 1, max_len=4, head_dim=2)
    cache.update(0, torch.randn(2, 1, 3, 2), torch.randn(2, 1, 3, 2))
    cache.reset()
    assert cache.next_pos() == 0
    assert cache.lengths.tolist() == [0, 0]
    cache.update(0, torch.randn(2, 1, 4, 2), torch.randn(2, 1, 4, 2))  # the whole buffer again
    cache.truncate(2)
    assert cache.next_pos() == 2
    with pytest.raises(AttentionInputError, match="only be shortened"):
        cache.truncate(3)


def _gpt(seed: int = 0, **kw: int) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=97, max_positions=64, dim=32, num_layers=3, num_heads=4, **kw)
    model = GPT(cfg).eval()
    for p in model.parameters():  # larger weights than GPT-2's init: a sharper test
        p.data.normal_(0, 0.2)
    return model


@pytest.mark.parametrize("chunks", [[1] * 12, [5, 1, 1, 1, 4], [3, 3, 3, 3], [12]])
def test_gpt_incremental_decoding_equals_full_forward(chunks: list[int]) -> None:
    model = _gpt()
    ids = torch.randint(0, 97, (2, 12))
    cache = model.new_cache(2, max_len=12)
    with torch.no_grad():
        full = model(ids)  # (B, T, V)
        parts, t = [], 0
        for n in chunks:
            parts.append(model(ids[:, t : t + n], kv_cache=cache))
            t += n
    assert cache[0].next_pos() == 12
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=ATOL, rtol=0)


def test_ragged_batch_decoding_equals_each_sequence_alone() -> None:
    model = _gpt(1)
    lengths = [7, 3, 5]
    ids = torch.randint(0, 97, (3, 7))
    mask = torch.arange(7) < torch.tensor(lengths)[:, None]  # right padding
    extra = torch.randint(0, 97, (3, 4))  # 4 more tokens per sequence, fed one by one
    cache = model.new_cache(3, max_len=11)
    with torch.no_grad():
        prefill = model(ids, attention_mask=mask, kv_cache=cache)  # (3, 7, V)
        assert cache[0].lengths.tolist() == lengths
        steps = [model(extra[:, i : i + 1], kv_cache=cache) for i in range(4)]
        for b, n in enumerate(lengths):
            alone = model(torch.cat([ids[b : b + 1, :n], extra[b : b + 1]], dim=1))
            torch.testing.assert_close(prefill[b, :n], alone[0, :n], atol=ATOL, rtol=0)
            got = torch.cat([s[b] for s in steps], dim=0)
            torch.testing.assert_close(got, alone[0, n:], atol=ATOL, rtol=0)


def test_a_key_mask_for_every_sequence_broadcasts_over_a_ragged_cache() -> None:
    """A (1, 1, 1, S) bool mask applies to every sequence, as the same mask expanded to
    (B, 1, 1, S) does, also after ``truncate`` made the cache's lengths differ."""
    torch.manual_seed(6)
    mha = attnkit.MultiHeadAttention(16, 2, causal=True).eval()
    x0, x = torch.randn(2, 5, 16), torch.randn(2, 1, 16)
    keep = torch.zeros(1, 1, 1, 6, dtype=torch.bool)
    keep[..., :2] = True
    outs = []
    for mask in (keep, keep.expand(2, 1, 1, 6).clone()):
        cache = KVCache(2, 2, max_len=8, head_dim=8)
        with torch.no_grad():
            mha(x0, kv_cache=cache)
            cache.truncate(torch.tensor([3, 5]))
            outs.append(mha(x, kv_cache=cache, mask=mask).output)
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    alone = torch.cat([outs[0][0], outs[0][1]])
    assert not torch.equal(alone[0], alone[1])  # two sequences, two answers


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_gqa_attention_with_cache_equals_full(layout: str) -> None:
    torch.manual_seed(4)
    rope = RotaryEmbedding(8, layout=layout, base=500.0)  # type: ignore[arg-type]
    mha = attnkit.MultiHeadAttention(48, 6, num_kv_heads=2, causal=True, rope=rope).eval()
    x = torch.randn(2, 9, 48)
    cache = KVCache(2, 2, max_len=9, head_dim=8)
    with torch.no_grad():
        full = mha(x).output
        parts = [mha(x[:, :4], kv_cache=cache).output]
        parts += [mha(x[:, t : t + 1], kv_cache=cache).output for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=ATOL, rtol=0)


def test_alibi_stack_with_cache_equals_full() -> None:
    torch.manual_seed(5)
    stack = TransformerStack(TransformerConfig(dim=32, num_heads=4, norm_first=True), 2).eval()
    x = torch.randn(2, 8, 32)
    spec = alibi(4) & causal()
    cache = [KVCache(2, 4, max_len=8, head_dim=8) for _ in range(2)]
    with torch.no_grad():
        full = stack(x, mask=spec).last_hidden_state
        parts = [stack(x[:, :5], mask=spec, kv_cache=cache).last_hidden_state]
        parts += [
            stack(x[:, t : t + 1], mask=spec, kv_cache=cache).last_hidden_state for t in (5, 6, 7)
        ]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=ATOL, rtol=0)


def test_module_level_cache_errors() -> None:
    mha = attnkit.MultiHeadAttention(16, 2, causal=True)
    cache = KVCache(1, 2, max_len=4, head_dim=8)
    x = torch.randn(1, 3, 16)
    with pytest.raises(AttentionInputError, match="serve self-attention"):
        mha(x, torch.randn(1, 3, 16), kv_cache=cache)
    with pytest.raises(AttentionInputError, match="padding is the cache's per-sequence lengths"):
        mha(x, key_padding_mask=torch.zeros(1, 3, dtype=torch.bool), kv_cache=cache)
    with pytest.raises(AttentionInputError, match="`attention_mask` is not taken"):
        mha(x, attention_mask=torch.ones(1, 3, dtype=torch.bool), kv_cache=cache)
    with pytest.raises(AttentionInputError, match="no rotary embedding"):
        mha(x, positions=torch.arange(3))
    mha(x, kv_cache=cache)
    with pytest.raises(AttentionInputError, match="max_len=4"):
        mha(x, kv_cache=cache)
    stack = TransformerStack(TransformerConfig(dim=16, num_heads=2), 2)
    with pytest.raises(AttentionInputError, match="one KVCache per layer"):
        stack(x, kv_cache=[cache])


@pytest.mark.parametrize(
    "mask",
    [
        attnkit.masks.sliding_window(3),
        causal() & attnkit.masks.sliding_window(2),
        attnkit.masks.alibi(2),
        ~attnkit.masks.sliding_window(2),
    ],
    ids=["window", "causal-window", "alibi", "not-window"],
)
def test_a_rule_placed_from_the_end_is_refused_on_a_ragged_cache(mask: object) -> None:
    """Sequences of 3 and 5 cached tokens: a window (or ALiBi) counted from the end of the keys
    would place sequence 0's new token after key 4, not after its own last key 2; refused with
    the lengths, where it would have been a silently wrong answer."""
    torch.manual_seed(7)
    mha = attnkit.MultiHeadAttention(16, 2, causal=True).eval()
    cache = KVCache(2, 2, max_len=8, head_dim=8)
    with torch.no_grad():
        mha(torch.randn(2, 5, 16), kv_cache=cache)
        cache.truncate(torch.tensor([3, 5]))
        with pytest.raises(AttentionInputError) as info:
            mha(torch.randn(2, 1, 16), kv_cache=cache, mask=mask)
    text = str(info.value)
    assert "counts query positions from the end of the keys" in text
    assert "cached lengths [3, 5]" in text
    assert cache.lengths.tolist() == [3, 5]  # refused before anything was written
    assert "separate batches" in text


def test_a_mask_of_keys_alone_on_a_ragged_cache_equals_each_sequence_alone() -> None:
    """key_mask (keys alone) on a ragged cache: each sequence's new token equals the same
    sequence decoded alone with its own keys masked the same way."""
    torch.manual_seed(8)
    mha = attnkit.MultiHeadAttention(16, 2, causal=True).eval()
    x0, x = torch.randn(2, 5, 16), torch.randn(2, 1, 16)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[:, 0] = False  # nobody sees the first token
    cache = KVCache(2, 2, max_len=8, head_dim=8)
    with torch.no_grad():
        mha(x0, kv_cache=cache)
        cache.truncate(torch.tensor([3, 5]))
        got = mha(x, kv_cache=cache, mask=attnkit.masks.key_mask(keep)).output
        for b, n in enumerate([3, 5]):
            alone = KVCache(1, 2, max_len=8, head_dim=8)
            mha(x0[b : b + 1, :n], kv_cache=alone)
            want = mha(
                x[b : b + 1], kv_cache=alone, mask=attnkit.masks.key_mask(keep[b : b + 1, : n + 1])
            ).output
            torch.testing.assert_close(got[b : b + 1], want, atol=1e-5, rtol=0)


def _thp_mode() -> str | None:
    """The kernel's transparent huge page setting (``always``, ``madvise``, ``never``)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="no transparent huge pages here")
def test_large_cpu_buffers_ask_for_huge_pages() -> None:
    """A buffer of 4 MiB or more is advised MADV_HUGEPAGE ("hg" in its mapping's VmFlags) on
    its 2 MiB-aligned part, is zeros and caches what is written; a small one is zeros too."""
    from attnkit.modules.kv_cache import HUGE_PAGE

    cache = KVCache(1, 8, 4096, 128)  # 16 MiB each for k and v
    for buf in (cache.k, cache.v):
        assert not buf.any()
        inner = -(-buf.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # inside the aligned part
        assert "hg" in _vm_flags(inner)
    k, v = cache.update(0, torch.ones(1, 8, 3, 128), torch.ones(1, 8, 3, 128))
    assert k.shape == (1, 8, 3, 128)
    assert bool(k.eq(1).all())
    assert bool(v.eq(1).all())
    small = KVCache(1, 2, 16, 8)
    assert small.k.numel() * 4 < 2 * HUGE_PAGE
    assert not small.k.any()
