"""attnkit.distributed in one process: the block functions and the merge, a group of one, and
every input check with its message (the multi-process tests are in test_ring.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import attnkit
import attnkit.distributed as akd
from attnkit import masks
from attnkit.backends.blocked import BlockAt, merge
from attnkit.distributed import ring
from attnkit.modules.positions import RotaryEmbedding


@pytest.fixture
def group_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _qkvg(L: int, S: int, *, H: int = 4, Hkv: int = 2, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, L, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, Hkv, S, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, Hkv, S, 5, generator=gen, dtype=torch.float64)
    g = torch.randn(2, H, L, 5, generator=gen, dtype=torch.float64)
    return q, k, v, g


SPECS = {
    "none": None,
    "causal": masks.causal(),
    "causal_window": masks.causal() & masks.sliding_window(4),
    "padding_rows": masks.padding(torch.tensor([13, 6]), q_lengths=torch.tensor([9, 4])),
    "documents": masks.document(torch.tensor([0] * 5 + [1] * 4 + [2] * 6)),
    "prefix": masks.prefix_lm(3),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_block_pieces_merge_to_the_whole(name: str) -> None:
    """Query chunks x key chunks at their global positions, merged by log-sum-exp, and their
    gradients given the final out/lse, equal attention on the whole sequence (L != S)."""
    spec = SPECS[name]
    L, S = 11, 15
    q, k, v, g = _qkvg(L, S)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attnkit.attention(*full, mask=spec)
    (ref * g).sum().backward()
    q_cuts, k_cuts = [(0, 4), (4, 11)], [(0, 6), (6, 7), (7, 15)]
    out = torch.zeros(2, 4, L, 5, dtype=torch.float64)
    lse = torch.full((2, 4, L), float("-inf"), dtype=torch.float64)
    for a, z in q_cuts:
        for c, e in k_cuts:
            o, lse_o = ring.forward_with_lse(
                q[:, :, a:z], k[:, :, c:e], v[:, :, c:e], mask=spec, scale=8**-0.5,
                at=BlockAt(a, c, L, S),
            )  # fmt: skip
            merge(out[:, :, a:z], lse[:, :, a:z], o, lse_o)  # the rule ring attention uses
    assert (out - ref).abs().max() <= 1e-12
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for a, z in q_cuts:
        for c, e in k_cuts:
            dq, dk, dv = ring.backward_from_lse(
                q[:, :, a:z], k[:, :, c:e], v[:, :, c:e], out[:, :, a:z], g[:, :, a:z],
                lse[:, :, a:z], mask=spec, scale=8**-0.5,
                at=BlockAt(a, c, L, S),
            )  # fmt: skip
            grads[0][:, :, a:z] += dq
            grads[1][:, :, c:e] += dk
            grads[2][:, :, c:e] += dv
    for got, want in zip(grads, full, strict=True):
        assert want.grad is not None
        assert (got - want.grad).abs().max() <= 1e-12


def test_group_of_one_is_plain_attention(group_of_one: None) -> None:
    q, k, v, g = _qkvg(12, 12)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attnkit.attention(*full, causal=True)
    (ref * g).sum().backward()
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    with akd.profile() as prof:
        out = akd.ring_attention(*mine, causal=True)
        (out * g).sum().backward()
    assert (out - ref).abs().max() <= 1e-12
    for a, b in zip(mine, full, strict=True):
        assert a.grad is not None
        assert b.grad is not None
        assert (a.grad - b.grad).abs().max() <= 1e-12
    assert [(s.phase, s.step, s.bytes_sent) for s in prof.steps] == [
        ("forward", 0, 0),
        ("backward", 0, 0),
    ]
    assert "phase" in str(prof)


def test_sequence_parallel_of_one_is_the_module(group_of_one: None) -> None:
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2, causal=True, rope=RotaryEmbedding(4))
    x = torch.randn(2, 10, 16)
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[1, 7:] = False
    want = mha(x, key_padding_mask=~keep).output
    sp = akd.SequenceParallel(mha)
    assert list(sp.state_dict()) == list(mha.state_dict())
    got = sp(x, key_padding_mask=~keep).output
    assert (got - want).abs().max() <= 1e-5
    assert (sp(x, attention_mask=keep.long()).output - want).abs().max() <= 1e-5


def test_outside_a_process_group_the_error_says_how_to_start_one() -> None:
    assert not dist.is_initialized()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(attnkit.AttentionInputError, match="not initialised") as e:
        akd.ring_attention(q, q, q)
    assert "init_process_group" in str(e.value)


def test_dense_masks_are_refused(group_of_one: None) -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(attnkit.AttentionInputError, match="takes mask specs") as e:
        akd.ring_attention(q, q, q, mask=torch.ones(4, 4, dtype=torch.bool))
    assert "padding(lengths)" in str(e.value)


def test_local_shapes_are_checked_by_attnkit_validation(group_of_one: None) -> None:
    with pytest.raises(attnkit.AttentionInputError, match="does not divide the 3 heads"):
        akd.ring_attention(
            torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
        )


def test_causal_shards_must_hold_two_equal_chunks(group_of_one: None) -> None:
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(attnkit.AttentionInputError, match="odd length") as e:
        akd.ring_attention(q, q, q, causal=True)
    assert "shard(x, causal=True)" in str(e.value)


def test_shard_says_how_to_pad(group_of_one: None) -> None:
    with pytest.raises(attnkit.AttentionInputError, match="does not split into 2 equal") as e:
        akd.shard(torch.randn(1, 7, 4), causal=True)
    assert "pad the sequence to 8 tokens" in str(e.value)
    assert torch.equal(
        akd.shard(torch.arange(6.0)[:, None], causal=True), torch.arange(6.0)[:, None]
    )


@pytest.mark.parametrize("timeout", [0, -1.0, "10", float("inf")])
def test_timeout_must_be_positive(group_of_one: None, timeout: object) -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(attnkit.AttentionInputError, match="`timeout` must be a positive"):
        akd.ring_attention(q, q, q, timeout=timeout)  # type: ignore[arg-type]


def test_sequence_parallel_refuses_what_it_cannot_do_exactly(group_of_one: None) -> None:
    sp = akd.SequenceParallel(attnkit.MultiHeadAttention(16, 4, dropout=0.1))
    x = torch.randn(2, 6, 16)
    with pytest.raises(attnkit.AttentionInputError, match="dropout is not supported"):
        sp(x)
    sp.eval()
    with pytest.raises(attnkit.AttentionInputError, match="never materialises the attention"):
        sp(x, need_weights=True)
    with pytest.raises(attnkit.AttentionInputError, match="covers the whole sequence") as e:
        sp(x, key_padding_mask=torch.ones(6, 2, dtype=torch.bool))
    assert "target (B=2, N=6)" in str(e.value)
    assert e.value.fix == "it looks transposed: use key_padding_mask.T"
    with pytest.raises(attnkit.AttentionInputError, match="covers the whole sequence") as e:
        sp(x, attention_mask=torch.ones(2, 5, dtype=torch.bool))
    assert e.value.fix == "pass the same full mask on every rank (not a shard of it)"
    with pytest.raises(attnkit.AttentionInputError, match="takes no float mask") as e:
        sp(x, key_padding_mask=torch.zeros(2, 6))
    assert e.value.argument == "key_padding_mask"
    with pytest.raises(attnkit.AttentionInputError, match="values other than 0 and 1: \\[2\\]"):
        sp(x, attention_mask=torch.full((2, 6), 2))
    with pytest.raises(attnkit.AttentionInputError, match=r"wraps an attnkit\.MultiHeadAttention"):
        akd.SequenceParallel(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


def test_parallelize_swaps_every_multi_head_attention() -> None:
    from attnkit.modules.transformer import TransformerConfig, TransformerStack

    model = TransformerStack(TransformerConfig(dim=16, num_heads=4), num_layers=3)
    keys = list(model.state_dict())
    akd.parallelize(model)
    assert sum(isinstance(m, akd.SequenceParallel) for m in model.modules()) == 3
    assert not any(isinstance(m, attnkit.MultiHeadAttention) for m in model.modules())
    assert list(model.state_dict()) == keys


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, 3])
def test_kv_heads_per_pass_must_be_one_to_hkv(group_of_one: None, bad: object) -> None:
    q = torch.randn(1, 4, 4, 8)
    k = torch.randn(1, 2, 4, 8)
    with pytest.raises(attnkit.AttentionInputError, match="kv_heads_per_pass") as e:
        akd.ring_attention(q, k, k, kv_heads_per_pass=bad)  # type: ignore[arg-type]
    msg = str(e.value)
    assert f"kv_heads_per_pass={bad!r}" in msg
    assert "Hkv=2" in msg
    assert "an int in 1..2" in msg
    assert "from 1 to the 2 there are" in msg  # more than Hkv is refused, never clamped


def test_one_head_group_at_a_time_is_the_same_attention(group_of_one: None) -> None:
    from attnkit.modules.positions import alibi

    q, k, v, g = _qkvg(12, 12, H=6, Hkv=3)
    spec = alibi(6) & masks.sliding_window(5)
    grads = []
    for per_pass in (None, 1, 2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with akd.profile() as prof:
            out = akd.ring_attention(*leaves, mask=spec, causal=True, kv_heads_per_pass=per_pass)
            (out * g).sum().backward()
        assert sorted({s.part for s in prof.steps}) == list(range({None: 1, 1: 3, 2: 2}[per_pass]))
        grads.append([out, *(t.grad for t in leaves)])
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            assert (a - b).abs().max() <= 1e-12
    ref = attnkit.attention(q, k, v, mask=spec, causal=True)
    assert (grads[1][0] - ref).abs().max() <= 1e-12


def test_long_shards_go_around_one_head_at_a_time() -> None:
    k = torch.empty(1, 4, 8192, 64)  # 2 MiB of K and 2 MiB of V per head and rank
    assert ring._kv_heads_per_pass(None, k, k) == 1
    small = torch.empty(2, 4, 64, 8)
    assert ring._kv_heads_per_pass(None, small, small) == 4
    assert ring._kv_heads_per_pass(3, small, small) == 3


def test_ring_sinks_of_a_group_of_one_are_plain_attentions(group_of_one: None) -> None:
    """Sinks per head and per token through the ring's join: the output and the gradients of
    q, k, v and the sinks are attention's; a SequenceParallel shares its module's learned
    sinks (the same state_dict) and gives the module's output."""
    q, k, v, g = _qkvg(12, 12)
    for sinks in (torch.randn(4, dtype=torch.float64), torch.randn(2, 4, 12, dtype=torch.float64)):
        full = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        ref = attnkit.attention(*full[:3], causal=True, sinks=full[3])
        (ref * g).sum().backward()
        mine = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = akd.ring_attention(*mine[:3], causal=True, sinks=mine[3])
        (out * g).sum().backward()
        assert (out - ref).abs().max() <= 1e-12
        for a, b in zip(mine, full, strict=True):
            assert a.grad is not None
            assert b.grad is not None
            assert (a.grad - b.grad).abs().max() <= 1e-12
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2, causal=True, sinks=True)
    sp = akd.SequenceParallel(mha)
    assert sp.sinks is mha.sinks
    assert list(sp.state_dict()) == list(mha.state_dict())
    x = torch.randn(2, 10, 16)
    assert (sp(x).output - mha(x).output).abs().max() <= 1e-5


@pytest.mark.parametrize(
    ("sinks", "got", "fix"),
    [
        (torch.zeros(4), "sinks torch.float32 on cpu, q torch.float64 on cpu", "sinks.to(dtype="),
        (torch.zeros(4, dtype=torch.float64, device="meta"), "sinks torch.float64 on meta", "cpu"),
        (torch.zeros(2, 8, 4, dtype=torch.float64), "sinks (B=2, H=8, L=4)", "transpose(1, 2)"),
        ([0.0] * 4, "sinks: list", None),
    ],
    ids=["dtype", "device", "transposed", "list"],
)
def test_ring_sinks_are_checked_by_attnkit_validation(
    group_of_one: None, sinks: object, got: str, fix: str | None
) -> None:
    q, k, v, _ = _qkvg(8, 8)
    with pytest.raises(attnkit.AttentionInputError) as info:
        akd.ring_attention(q, k, v, sinks=sinks)  # type: ignore[arg-type]
    err = info.value
    assert err.where == "attnkit.distributed.ring_attention"
    assert err.argument == "sinks"
    assert got in err.got
    assert err.expected == (
        "sinks (H=4,) or (B=2, H=4, L=8) or (1, H=4, L=8), of dtype torch.float64 on cpu"
    )
    if fix is None:
        assert err.fix is None
    else:
        assert err.fix is not None
        assert fix in err.fix
