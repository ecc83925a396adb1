"""The ``input_ids`` check that BertEncoder and GPT share: the same message from both models.

Small random models (no weights needed); each case reads the whole message.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from attnkit import AttentionInputError
from attnkit.models import GPT, BertConfig, BertEncoder, GPTConfig
from attnkit.models.token_ids import check_token_ids

V = 50
ENCODE = "attnkit.models.encode(texts, tokenizer) gives input_ids and attention_mask"
UNSQUEEZE = "add a batch dim with input_ids.unsqueeze(0)"

BERT = BertEncoder(
    BertConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
    )
).eval()
GPT_MODEL = GPT(GPTConfig(vocab_size=V, max_positions=16, dim=16, num_layers=1, num_heads=2)).eval()

# the model, its name in the message, the start of its fix for a wrong rank or dtype
MODELS = [
    pytest.param(BERT, "attnkit.models.BertEncoder", f"{ENCODE}; {UNSQUEEZE}", id="bert"),
    pytest.param(GPT_MODEL, "attnkit.models.GPT", UNSQUEEZE, id="gpt"),
]


def _error(call: Callable[[], object]) -> AttentionInputError:
    with pytest.raises(AttentionInputError) as info:
        call()
    assert info.value.argument == "input_ids"
    return info.value


@pytest.mark.parametrize(("model", "where", "fix"), MODELS)
@pytest.mark.parametrize(
    ("ids", "got"),
    [
        pytest.param(torch.ones(1, 4), "input_ids (B=1, T=4) dtype=torch.float32", id="float"),
        pytest.param(
            torch.ones(1, 4, dtype=torch.bool), "input_ids (B=1, T=4) dtype=torch.bool", id="bool"
        ),
        pytest.param(
            torch.ones(4, dtype=torch.long), "input_ids (1-D: 4, ) dtype=torch.int64", id="1-d"
        ),
        pytest.param([[1, 2]], "input_ids: list", id="list"),
    ],
)
def test_not_integer_ids_b_t(
    model: torch.nn.Module, where: str, fix: str, ids: object, got: str
) -> None:
    e = _error(lambda: model(ids))
    assert str(e) == (
        f"{where}: `input_ids` must be a 2-D tensor of integer token ids.\n"
        f"  got:      {got}\n"
        "  expected: input_ids (B, T), int64\n"
        f"  fix:      {fix}"
    )


@pytest.mark.parametrize(("model", "where", "fix"), MODELS)
@pytest.mark.parametrize(
    ("ids", "got"),
    [
        pytest.param([[0, V]], f"ids from 0 to {V}", id="vocab_size"),
        pytest.param([[-1, 3]], "ids from -1 to 3", id="negative"),
    ],
)
def test_ids_outside_the_vocabulary(
    model: torch.nn.Module, where: str, fix: str, ids: list[list[int]], got: str
) -> None:
    e = _error(lambda: model(torch.tensor(ids)))
    assert str(e) == (
        f"{where}: token ids must be in [0, {V}).\n"
        f"  got:      {got}\n"
        f"  expected: 0 <= id < vocab_size = {V}"
    )
    assert e.fix is None


def test_valid_ids_pass_and_empty_batches_are_not_range_checked() -> None:
    check_token_ids("f", torch.tensor([[0, V - 1]]), V)
    check_token_ids("f", torch.zeros(2, 0, dtype=torch.long), V)
    check_token_ids("f", torch.tensor([[0, 1]], dtype=torch.int32), V)
    assert BERT(torch.tensor([[0, V - 1]])).last_hidden_state.shape == (1, 2, 16)
    assert GPT_MODEL(torch.tensor([[0, V - 1]])).shape == (1, 2, V)
