"""torch.compile(fullgraph=True) over attnkit.attention, with mask specs.

Inside a compiled graph the ``blocked`` backend runs as one custom op
(``attnkit::blocked_attention``), so a compiled model keeps attnkit's block-sparse kernels; the
``flex`` backend calls ``flex_attention`` itself. Compiling costs seconds on a 2-core CPU, so the
cases are few and small: one through inductor (torch.compile's default), the others through
``aot_eager`` (Dynamo and AOT autograd: what decides whether a call traces and differentiates,
without generating C++) or ``eager`` (Dynamo alone).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import pytest
import torch

import attnkit
from attnkit import AttentionInputError, masks
from attnkit.backends.blocked import compiled, rowspan_builds
from attnkit.masks import MaskSpec
from oracle import reference_attention

TOL = {"atol": 1e-5, "rtol": 1e-5}

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method`:DeprecationWarning")


def _qkv(L: int, seed: int, Hkv: int = 2, Dv: int = 8) -> list[torch.Tensor]:
    """q, k, v of 4 query heads and ``Hkv`` key/value heads, ``Dk = 16``."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((2, 4, L, 16), (2, Hkv, L, 16), (2, Hkv, L, Dv))
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def _run(fn: Callable[..., torch.Tensor], qkv: list[torch.Tensor], *args: Any) -> list[Any]:
    """Output and the gradients of q, k, v of ``(out * w).sum()`` (fixed random weights)."""
    for t in qkv:
        t.grad = None
    out = fn(*qkv, *args)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * w).sum().backward()
    return [out.detach(), *(t.grad for t in qkv)]


def _assert_all_close(got: list[Any], want: list[Any]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.fixture
def op_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts the forward and backward runs of attnkit's custom op (its real implementation)."""
    calls: list[str] = []
    for name in ("forward_with_lse", "backward_from_lse"):
        real = getattr(compiled, name)

        def counting(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls.append(_name)
            return _real(*args, **kw)

        monkeypatch.setattr(compiled, name, counting)
    return calls


def window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return attnkit.attention(q, k, v, mask=masks.causal() & masks.sliding_window(64))


def test_a_window_compiles_with_inductor_and_keeps_the_blocked_kernels(
    op_calls: list[str],
) -> None:
    qkv = _qkv(256, seed=0, Hkv=4, Dv=16)  # the row-span kernel's case
    report = attnkit.explain(*qkv, mask=masks.causal() & masks.sliding_window(64))
    assert report.chosen == "blocked"
    assert report.notes["blocked"] == (
        f"causal sliding window 64: forward and backward run {rowspan_builds.status()} "
        "(one pass each, no tiles); under torch.compile the same, as one custom op "
        "(attnkit::blocked_attention)"
    )
    with torch._inductor.config.patch(compile_threads=1):
        got = _run(torch.compile(window, fullgraph=True), qkv)
    assert op_calls == ["forward_with_lse", "backward_from_lse"]  # the op ran, not a dense path
    _assert_all_close(got, _run(window, qkv))
    q, k, v = qkv
    dense = (masks.causal() & masks.sliding_window(64)).to_dense(256, 256)
    torch.testing.assert_close(got[0].double(), reference_attention(q, k, v, mask=dense)[0], **TOL)


def capped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    spec = masks.alibi(4) & masks.causal() & masks.sliding_window(48)
    return attnkit.attention(q, k, v, mask=spec, softcap=5.0, sinks=sinks)


def test_soft_cap_sinks_and_alibi_compile_as_the_op_with_the_sinks_gradient(
    op_calls: list[str],
) -> None:
    """Gemma 2's soft-cap, gpt-oss's sinks and ALiBi under torch.compile: the blocked op serves
    them (the row-span kernel inside), forward and backward, the sinks' gradient included; the
    same numbers as eager and the float64 oracle."""
    qkv = _qkv(192, seed=5)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(6)).requires_grad_()
    spec = masks.alibi(4) & masks.causal() & masks.sliding_window(48)
    report = attnkit.explain(*qkv, mask=spec, softcap=5.0, sinks=sinks, backend="blocked")
    assert report.notes["blocked"] == (
        "row spans of alibi(4) & causal() & sliding_window(48), soft-capped at 5: forward and "
        f"backward run {rowspan_builds.status()} (one pass each, no tiles); under "
        "torch.compile the same, as one custom op (attnkit::blocked_attention)"
    )
    fn = torch.compile(capped, fullgraph=True, backend="aot_eager")
    got = _run(fn, qkv, sinks)
    got_dsinks, sinks.grad = sinks.grad, None
    assert op_calls == ["forward_with_lse", "backward_from_lse"]
    _assert_all_close(got, _run(capped, qkv, sinks))
    torch.testing.assert_close(got_dsinks, sinks.grad, **TOL)
    leaves = [t.detach().double().requires_grad_() for t in (*qkv, sinks)]
    want, _ = reference_attention(
        *leaves[:3], mask=spec.to_dense(192, 192, dtype=torch.float64), softcap=5.0, sinks=leaves[3]
    )
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)).double()  # as _run
    (want * w).sum().backward()
    torch.testing.assert_close(got[0].double(), want.detach(), **TOL)
    for a, leaf in zip((*got[1:], got_dsinks), leaves, strict=True):
        torch.testing.assert_close(a.double(), leaf.grad, atol=1e-4, rtol=1e-4)


def documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return attnkit.attention(q, k, v, mask=masks.document(ids) & masks.causal())


def test_documents_from_an_input_tensor_are_planned_when_the_op_runs(
    op_calls: list[str],
) -> None:
    """The document ids are an input of the compiled function: the plan reads their values at
    run time, so new ids give new (right) answers without a graph per batch."""
    qkv = _qkv(256, seed=2)
    fn = torch.compile(documents, fullgraph=True, backend="aot_eager")
    for seed in (3, 4):
        cuts = torch.randint(0, 2, (2, 256), generator=torch.Generator().manual_seed(seed))
        ids = cuts.cumsum(1) // 40  # (B, S): new documents at random places, per sequence
        _assert_all_close(_run(fn, qkv, ids), _run(documents, qkv, ids))
    assert op_calls == ["forward_with_lse", "backward_from_lse"] * 2  # eager calls not counted


def causal_flag(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return attnkit.attention(q, k, v, causal=True)


def test_the_causal_flag_compiles() -> None:
    qkv = _qkv(64, seed=5)
    fn = torch.compile(causal_flag, fullgraph=True, backend="aot_eager")
    _assert_all_close(_run(fn, qkv), _run(causal_flag, qkv))


def test_a_new_length_recompiles_with_symbolic_sizes(op_calls: list[str]) -> None:
    """The second length makes Dynamo trace sizes as symbols: the spec's ints reach the op as
    symbolic ints, and the fake implementation answers with symbolic shapes."""
    fn = torch.compile(window, fullgraph=True, backend="eager")
    for L in (256, 320):
        qkv = _qkv(L, seed=L)
        _assert_all_close(_run(fn, qkv), _run(window, qkv))
    assert op_calls == ["forward_with_lse", "backward_from_lse"] * 2


def flex_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor) -> Any:
    return attnkit.attention(q, k, v, mask=masks.document(ids) & masks.causal(), backend="flex")


def test_flex_compiles_into_the_callers_graph() -> None:
    q, k, v = (t.detach() for t in _qkv(256, seed=6))
    ids = torch.arange(256) // 100
    note = attnkit.explain(q, k, v, mask=masks.document(ids), backend="flex").notes["flex"]
    assert "under torch.compile, flex_attention is compiled into the caller's graph" in note
    with torch.no_grad():  # flex has no backward on CPU
        out = torch.compile(flex_documents, fullgraph=True, backend="aot_eager")(q, k, v, ids)
    dense = (masks.document(ids) & masks.causal()).to_dense(256, 256)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, mask=dense)[0], **TOL)


def _specs() -> list[MaskSpec]:
    lengths = torch.tensor([200, 90])
    return [
        masks.causal() & masks.sliding_window(64),
        masks.document(torch.arange(256) // 50) | ~masks.padding(lengths, q_lengths=lengths),
        masks.key_mask(torch.arange(256)[None].expand(2, -1) % 3 > 0),
        masks.prefix_lm(torch.tensor([10, 30])),
        masks.prefix_lm(7),
        (masks.alibi(4) & masks.causal()).select_heads(1, 3),
        masks.sequence_causal(torch.tensor([256, 200]), 256),
        masks.as_spec(torch.randn(2, 1, 256, 256), True, L=256, S=256),
    ]


@pytest.mark.parametrize("spec", _specs(), ids=repr)
def test_flatten_and_rebuild_give_the_same_spec(spec: MaskSpec) -> None:
    flat = compiled.flatten(spec)
    assert not isinstance(flat, str)
    tensors, ints, floats, structure = flat
    assert all(isinstance(t, torch.Tensor) for t in tensors)
    back = compiled.rebuild(tensors, ints, floats, structure)
    assert type(back) is type(spec)
    assert repr(back) == repr(spec)
    key: Hashable = spec.key()
    assert back.key() == key
    torch.testing.assert_close(back.to_dense(256, 256), spec.to_dense(256, 256))
    torch.testing.assert_close(back.block_map(256, 256).state, spec.block_map(256, 256).state)


def test_the_op_passes_torchs_op_checks() -> None:
    q, k, v = _qkv(160, seed=7)
    ids = torch.arange(160) // 70
    tensors, ints, floats, structure = compiled.flatten(masks.document(ids) & masks.causal())
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    args = (q, k, v, None, tensors, ints, floats, structure, [0.25, 0.0])
    torch.library.opcheck(torch.ops.attnkit.blocked_attention.default, args, test_utils=checks)
    out, lse = torch.ops.attnkit.blocked_attention(*args)
    dout = torch.randn_like(out)
    back = ([q, k, v, out.detach(), lse], dout, tensors, ints, floats, structure, [0.25, 0.0])
    backward = torch.ops.attnkit.blocked_attention_backward.default
    torch.library.opcheck(backward, back, test_utils=("test_schema", "test_faketensor"))


class Scaled(MaskSpec):
    """A user's spec holding a function: the op cannot take it apart."""

    def __init__(self) -> None:
        self.rule = lambda d: d < 8

    def allowed(self, b, h, q, kv, off):  # type: ignore[no-untyped-def]
        return self.rule((q + off - kv).abs())

    def block_bounds(self, q_lo, q_hi, k_lo, k_hi, off):  # type: ignore[no-untyped-def]
        every = torch.ones(q_lo.shape[0], k_lo.shape[1], dtype=torch.bool)
        return every[None, None], ~every[None, None]

    def __repr__(self) -> str:
        return "Scaled()"


def test_a_spec_the_op_cannot_take_is_refused_with_the_reason() -> None:
    q, k, v = (t.detach() for t in _qkv(160, seed=8))
    spec = Scaled()
    note = attnkit.explain(q, k, v, mask=spec).notes["blocked"]
    assert note.endswith(
        "under torch.compile it runs as a custom op, which takes the mask spec as tensors, "
        "numbers and the names of its classes, but Scaled.rule is a function, so it cannot "
        "serve a compiled call"
    )

    def auto(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attnkit.attention(q, k, v, mask=spec)

    def named(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attnkit.attention(q, k, v, mask=spec, backend="blocked")

    # auto takes the next backend (sdpa, on the materialised mask) inside the graph
    got = torch.compile(auto, fullgraph=True, backend="eager")(q, k, v)
    torch.testing.assert_close(got, auto(q, k, v), **TOL)
    # named, it refuses (the whole message reaches the caller without fullgraph)
    with pytest.raises(AttentionInputError) as info:
        torch.compile(named, backend="eager")(q, k, v)
    assert "backend 'blocked' cannot serve this call: under torch.compile" in str(info.value)
    assert "Scaled.rule is a function" in str(info.value)


def test_bad_input_under_fullgraph_reports_attnkits_error() -> None:
    """Dynamo turns an exception raised in a full graph into its own error, which names
    attnkit's error and its problem; without fullgraph, attnkit's error reaches the caller."""
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 3, 8, 16)

    def bad(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return attnkit.attention(q, k, k)

    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(bad, fullgraph=True, backend="eager")(q, k)
    assert (
        "AttentionInputError('attnkit.attention', 'k', '`k` has 3 heads, which does not "
        "divide the 2 heads of `q`.')"
    ) in str(info.value)
    with pytest.raises(AttentionInputError, match="fix:      give k and v a number of heads"):
        torch.compile(bad, backend="eager")(q, k)


@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_attnkits_models_compile_fullgraph_with_padding(model: str) -> None:
    """The models' value checks (token ids in range, positions in the table) are skipped while
    torch.compile traces, as attention()'s are: a compiled model has no data-dependent branch."""
    from attnkit.models import GPT, BertConfig, BertEncoder, GPTConfig

    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 9:] = False  # right padding
    if model == "gpt":
        net: torch.nn.Module = GPT(
            GPTConfig(vocab_size=50, max_positions=32, dim=32, num_layers=2, num_heads=4)
        )
    else:
        cfg = BertConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64,
        )  # fmt: skip
        net = BertEncoder(cfg)
    net.eval()

    def hidden(out: Any) -> torch.Tensor:
        return out if isinstance(out, torch.Tensor) else out.last_hidden_state

    with torch.no_grad():
        want = hidden(net(ids, attention_mask=mask))
        got = hidden(torch.compile(net, fullgraph=True, backend="eager")(ids, attention_mask=mask))
    torch.testing.assert_close(got, want, **TOL)
    with pytest.raises(AttentionInputError, match="token ids must be in"):
        net(ids + 100)  # eager mode still checks the values
