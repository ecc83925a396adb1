"""DeepSeek-V3.2's sparse attention (DSA) through ``attn_implementation="attnkit"``: the five
model types whose layers pass their indexer's top-k keys as ``indices=`` (deepseek_v32,
glm_moe_dsa, axk2, dots3_note, hy_v4) run on attnkit with ``masks.selected_keys`` intersected
with their mask spec (no L x S mask tensor reaches attnkit) and match eager, which scatters the
same top-k into its mask; top-k (4) is below the keys (9), so the selection matters."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

import attnkit.interop.hf_attention as hfa
from attnkit.interop import register_hf
from attnkit.masks import MaskSpec
from hf_tiny import ATOL_LOGITS, batch, pair, transformers

DSA_TYPES = ("deepseek_v32", "glm_moe_dsa", "axk2", "dots3_note", "hy_v4")


def _tiny(model_type: str) -> Any:
    """The model type's default config shrunk by benchmarks/hf_sweep.py's rule (``index_topk``
    4 where the config has the field; dots3_note sets it per layer, and the test below checks
    that the selection changes every one of these models)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_sweep.py"
    spec = importlib.util.spec_from_file_location("hf_sweep", path)
    assert spec is not None
    assert spec.loader is not None
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return sweep.tiny_config(transformers.CONFIG_MAPPING[model_type])


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The ``mask`` of every attnkit.attention call hf_attention makes from here on."""
    seen: list[object] = []
    real = hfa.attention

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["mask"])
        return real(*args, **kwargs)

    monkeypatch.setattr(hfa, "attention", recording)
    return seen


@pytest.mark.parametrize("model_type", DSA_TYPES)
def test_a_dsa_model_runs_its_top_k_keys_on_attnkit_and_matches_eager(
    model_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    register_hf()
    ref, ours = pair(_tiny(model_type))
    ids, mask = batch()  # the first row left-padded
    real = mask.bool()
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask).logits
        seen = _recording(monkeypatch)
        got = ours(input_ids=ids, attention_mask=mask).logits
    assert float((got - expected)[real].abs().max()) <= ATOL_LOGITS
    # every layer's mask is a spec, never an L x S tensor; the indexed layers' hold the
    # selection (dots3_note's sliding-window layers have no indexer)
    assert all(isinstance(m, MaskSpec) for m in seen), [type(m) for m in seen]
    assert any("selected_keys" in repr(m) for m in seen)
    with torch.no_grad(), monkeypatch.context() as m:  # the selection ignored: another model
        m.setattr(hfa, "_with_selected", lambda mask, causal, *rest: mask)
        dense = ours(input_ids=ids, attention_mask=mask).logits
    assert float((dense - expected)[real].abs().max()) > 1e-3


def test_a_dsa_model_generates_eager_s_tokens_on_attnkit_with_left_padding() -> None:
    """Prefill and decode steps (one query against the cache, its own top-k of the keys)."""
    register_hf()
    ref, ours = pair(_tiny("deepseek_v32"))
    ids, mask = batch()
    kw: dict[str, Any] = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        want = ref.generate(input_ids=ids, attention_mask=mask, **kw)
        got = ours.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(got, want)


def test_a_compiled_dsa_model_is_one_graph_and_matches_eager() -> None:
    """Under torch.compile transformers hands the layers its dense mask, and the indices are
    scattered into it (``selected_keys(...).to_dense``) inside the graph: no graph break (the
    eager scatter sizes a table by the largest key, a value; a trace searches each row's sorted
    keys instead), and the logits are attnkit eager's and eager's on the real tokens."""
    from torch._dynamo.testing import CompileCounterWithBackend

    register_hf()
    torch._dynamo.reset()
    ref, ours = pair(_tiny("deepseek_v32"))
    ids, mask = batch()
    real = mask.bool()
    counter = CompileCounterWithBackend("aot_eager")
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask).logits
        eager = ours(input_ids=ids, attention_mask=mask).logits
        got = torch.compile(ours, backend=counter)(input_ids=ids, attention_mask=mask).logits
    assert counter.frame_count == 1
    assert float((got - eager).abs().max()) <= 1e-5
    assert float((got - expected)[real].abs().max()) <= ATOL_LOGITS
