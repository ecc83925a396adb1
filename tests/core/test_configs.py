"""attnkit.configs.derive_config: one config made from another by the fields they share."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from attnkit import AttentionInputError
from attnkit.configs import derive_config
from attnkit.train.loop import TrainConfig
from attnkit.train.task_model import ModelConfig


@dataclass(frozen=True)
class _Source:
    dim: int = 8
    lr: float = 0.1  # not a field of _Target: not copied


@dataclass(frozen=True)
class _Target:
    dim: int = 1
    heads: int = 1
    cache: list[int] = field(default_factory=list, init=False)  # not an argument: not copied

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise AttentionInputError("test", "heads", "bad", got="", expected="")


def test_shared_fields_are_copied_values_set_the_rest() -> None:
    assert derive_config(_Target, _Source(), heads=4) == _Target(dim=8, heads=4)
    assert derive_config(_Target, _Source(dim=6)) == _Target(dim=6, heads=1)


def test_a_value_wins_over_a_shared_field() -> None:
    assert derive_config(_Target, _Source(dim=6), dim=3) == _Target(dim=3, heads=1)


def test_the_result_is_checked_by_its_class() -> None:
    with pytest.raises(AttentionInputError, match="bad"):
        derive_config(_Target, _Source(dim=6), heads=4)


def test_train_config_gives_the_model_its_sizes() -> None:
    config = TrainConfig(task="reverse", length=12, dim=32, num_layers=3, num_heads=2)
    task = config.make_task()
    assert config.model_config() == ModelConfig(
        vocab_size=task.vocab_size,
        num_classes=task.num_classes,
        max_length=12,
        dim=32,
        num_layers=3,
        num_heads=2,
    )
