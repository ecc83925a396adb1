"""Tasks that need attention and can be checked exactly; their data is generated here, seeded.

Dimension legend: B sequences, T tokens per sequence, V input vocabulary, C output classes.

A task maps inputs ``x (B, T)`` (token ids in ``[0, V)``) to targets ``y (B, T)`` (class ids in
``[0, C)``, or :data:`IGNORE` where a position is not scored). A model gets a sequence right when
every scored position is right; :func:`accuracy` reports that fraction and the per-token one.

- ``reverse``: ``y[i] = x[T-1-i]``. Every output reads the mirrored position: attention's
  anti-diagonal.
- ``sort``: ``y = sorted(x)``. Output ``i`` reads the input position that holds the i-th smallest
  token (found by content, after the model has ranked the tokens).
- ``kv_recall``: ``T/2`` tokens that each pair a distinct key with a value (``c:5``), then the
  ``T/2`` keys again in a shuffled order as queries (``c?``); each query's target is its key's
  value. A query attends to the pair that holds its key, wherever it is.

The held-out split is **disjoint from training by construction**: a sequence is held out exactly
when a fixed hash of its tokens is ``0 mod`` :data:`HOLDOUT_EVERY` (one in ten); the training
stream drops every such sequence and the held-out sets keep only them. All draws take a
``torch.Generator``, so the data of a run is a function of its seed.

>>> task = Reverse(length=6, vocab=10)
>>> x, y = task.sample(torch.Generator().manual_seed(0), 2)
>>> torch.equal(y, x.flip(-1))
True
>>> bool(task.is_held_out(task.draw(torch.Generator().manual_seed(1), 5, held_out=True)[0]).all())
True
"""

from __future__ import annotations

import string
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from attnkit.errors import AttentionInputError

__all__ = [
    "HOLDOUT_EVERY",
    "IGNORE",
    "TASKS",
    "Accuracy",
    "KVRecall",
    "Reverse",
    "Sort",
    "Task",
    "accuracy_from_predictions",
    "make_task",
]

IGNORE = -100  # target of a position that is not scored (cross_entropy's ignore_index)
HOLDOUT_EVERY = 10  # one sequence in this many is held out
_HASH_PRIME = 2_147_483_647  # 2**31 - 1
_HASH_SEED = 0x5EED  # the multipliers of the split hash; fixed forever, so splits never move
_LETTERS = string.ascii_lowercase


class Accuracy(NamedTuple):
    """``sequence``: fraction of sequences with every scored position right; ``token``: fraction
    of scored positions right; ``size``: how many sequences were checked."""

    sequence: float
    token: float
    size: int


def accuracy_from_predictions(pred: torch.Tensor, y: torch.Tensor) -> Accuracy:
    """Exact accuracy of class predictions ``pred (B, T)`` against targets ``y (B, T)``.

    >>> y = torch.tensor([[1, 2, IGNORE], [3, 4, 5]])
    >>> accuracy_from_predictions(torch.tensor([[1, 2, 0], [3, 0, 5]]), y)
    Accuracy(sequence=0.5, token=0.8, size=2)
    """
    scored = y != IGNORE  # (B, T)
    right = (pred == y) & scored
    seq = (right | ~scored).all(dim=-1).float().mean().item()
    tok = right.sum().item() / max(int(scored.sum().item()), 1)
    return Accuracy(float(seq), float(tok), int(y.shape[0]))


def _bad(task: str, name: str, problem: str, value: object, expected: str) -> AttentionInputError:
    return AttentionInputError(
        f"attnkit.train.{task}", name, problem, got=f"{name}={value!r}", expected=expected
    )


@dataclass(frozen=True)
class Task(ABC):
    """A task: its sizes, a sampler, the alignment attention should learn, and token names."""

    length: int  # T
    vocab: int  # the task's size knob (see each task)

    name: ClassVar[str]
    summary: ClassVar[str]  # one line, for the CLI
    alignment_name: ClassVar[str]  # what a query row should attend to
    min_vocab: ClassVar[int] = 2
    max_vocab: ClassVar[int] = len(_LETTERS)

    def __post_init__(self) -> None:
        for name in ("length", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise _bad(self.name, name, f"`{name}` must be an int >= 2.", value, "an int >= 2")
        if not self.min_vocab <= self.vocab <= self.max_vocab:
            raise _bad(
                self.name,
                "vocab",
                f"`vocab` must be in [{self.min_vocab}, {self.max_vocab}] for {self.name}.",
                self.vocab,
                f"{self.min_vocab} <= vocab <= {self.max_vocab}",
            )

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """``V``: the number of input token ids."""

    @property
    @abstractmethod
    def num_classes(self) -> int:
        """``C``: the number of output classes."""

    @abstractmethod
    def inputs(self, gen: torch.Generator, n: int) -> torch.Tensor:
        """``n`` random inputs of either split, ``x (n, T)`` int64."""

    @abstractmethod
    def targets(self, x: torch.Tensor) -> torch.Tensor:
        """The targets ``y (B, T)`` of inputs ``x (B, T)``."""

    @abstractmethod
    def alignment(self, x: torch.Tensor) -> torch.Tensor:
        """bool ``(B, T, T)``: True where key ``j`` is a right source for query row ``i``.

        Rows with no expected source (not scored) are all False.
        """

    @abstractmethod
    def token(self, i: int) -> str:
        """The name of input token id ``i``."""

    @abstractmethod
    def label(self, c: int) -> str:
        """The name of output class ``c``."""

    def sample(self, gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` random sequences of either split: ``x (n, T)``, ``y (n, T)``."""
        x = self.inputs(gen, n)
        return x, self.targets(x)

    def is_held_out(self, x: torch.Tensor) -> torch.Tensor:
        """bool ``(B,)``: which sequences of ``x (B, T)`` belong to the held-out split."""
        gen = torch.Generator().manual_seed(_HASH_SEED)
        mult = torch.randint(1, _HASH_PRIME, (x.shape[-1],), generator=gen)  # (T,)
        h = (x.long().cpu() * mult).sum(dim=-1) % _HASH_PRIME  # < T * 2**62: no overflow
        return h % HOLDOUT_EVERY == 0

    def draw(
        self, gen: torch.Generator, n: int, *, held_out: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` sequences of one split (training or held-out), ``x (n, T)``, ``y (n, T)``."""
        xs, ys, have = [], [], 0
        while have < n:
            # training keeps 9 in 10 draws, held-out 1 in 10: draw enough for one round, mostly
            want = (n - have) * (HOLDOUT_EVERY + 2 if held_out else 2)
            x, y = self.sample(gen, want)
            keep = self.is_held_out(x) == held_out
            xs.append(x[keep])
            ys.append(y[keep])
            have += int(keep.sum().item())
        return torch.cat(xs)[:n], torch.cat(ys)[:n]

    def describe(self, x: torch.Tensor) -> str:
        """One sequence ``x (T,)`` as its token names."""
        return " ".join(self.token(int(i)) for i in x)

    def describe_targets(self, y: torch.Tensor) -> str:
        """Targets or predictions ``(T,)`` as class names, ``.`` where not scored."""
        return " ".join("." if int(c) == IGNORE else self.label(int(c)) for c in y)


@dataclass(frozen=True)
class _Letters(Task):
    """A task over ``vocab`` letters ``a, b, ...``: the inputs are uniform letters and the
    outputs are letters again (``V = C = vocab``)."""

    @property
    def vocab_size(self) -> int:
        return self.vocab

    @property
    def num_classes(self) -> int:
        return self.vocab

    def inputs(self, gen: torch.Generator, n: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (n, self.length), generator=gen)  # (n, T)

    def token(self, i: int) -> str:
        return _LETTERS[i]

    def label(self, c: int) -> str:
        return _LETTERS[c]


@dataclass(frozen=True)
class Reverse(_Letters):
    """``y[i] = x[T-1-i]``; ``vocab`` letters ``a, b, ...``.

    >>> Reverse(length=4, vocab=8).alignment(torch.zeros(1, 4, dtype=torch.long))[0].int()
    tensor([[0, 0, 0, 1],
            [0, 0, 1, 0],
            [0, 1, 0, 0],
            [1, 0, 0, 0]], dtype=torch.int32)
    """

    length: int = 16
    vocab: int = 16

    name: ClassVar[str] = "reverse"
    summary: ClassVar[str] = "reverse a sequence of letters"
    alignment_name: ClassVar[str] = "the mirrored position T-1-i"

    def targets(self, x: torch.Tensor) -> torch.Tensor:
        return x.flip(-1)

    def alignment(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[-1]
        mirror = torch.eye(T, dtype=torch.bool).flip(-1)  # (T, T): [i, T-1-i]
        return mirror.expand(x.shape[0], T, T)


@dataclass(frozen=True)
class Sort(_Letters):
    """``y = sorted(x)`` (repeats allowed); ``vocab`` letters.

    >>> x, y = Sort(length=5, vocab=4).sample(torch.Generator().manual_seed(0), 1)
    >>> torch.equal(y, x.sort(dim=-1).values)
    True
    """

    length: int = 12
    vocab: int = 16

    name: ClassVar[str] = "sort"
    summary: ClassVar[str] = "sort a sequence of letters"
    alignment_name: ClassVar[str] = "the input position holding the i-th smallest letter"

    def targets(self, x: torch.Tensor) -> torch.Tensor:
        return x.sort(dim=-1).values

    def alignment(self, x: torch.Tensor) -> torch.Tensor:
        y = x.sort(dim=-1).values  # (B, T)
        return y[:, :, None] == x[:, None, :]  # (B, T, T): query i, key j holds y[i]


@dataclass(frozen=True)
class KVRecall(Task):
    """Key-value recall: ``T/2`` pair tokens (distinct keys), then those keys shuffled as queries.

    ``vocab`` is the number of keys (letters, at least ``T/2``); values are the digits
    ``0 .. VALUES-1``. Pair token ``key * VALUES + value`` is named ``c:5``; query token
    ``vocab * VALUES + key`` is named ``c?``. Targets: the value at each query, nothing at the
    pairs.

    >>> task = KVRecall(length=4, vocab=3)
    >>> x = torch.tensor([[2 * 8 + 5, 0 * 8 + 1, 3 * 8 + 0, 3 * 8 + 2]])  # c:5 a:1 a? c?
    >>> task.describe(x[0])
    'c:5 a:1 a? c?'
    >>> task.alignment(x)[0].int()
    tensor([[0, 0, 0, 0],
            [0, 0, 0, 0],
            [0, 1, 0, 0],
            [1, 0, 0, 0]], dtype=torch.int32)
    """

    length: int = 12
    vocab: int = 12

    VALUES: ClassVar[int] = 8
    name: ClassVar[str] = "kv_recall"
    summary: ClassVar[str] = "recall the value paired with each queried key"
    alignment_name: ClassVar[str] = "the pair token holding the queried key"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.length % 2:
            raise _bad(
                self.name,
                "length",
                "`length` must be even (pairs, then queries).",
                self.length,
                "2 * pairs",
            )
        if self.vocab < self.pairs:
            raise _bad(
                self.name,
                "vocab",
                "`vocab` (the number of keys) must be at least length / 2 (distinct keys).",
                self.vocab,
                f"vocab >= {self.pairs}",
            )

    @property
    def pairs(self) -> int:
        return self.length // 2

    @property
    def vocab_size(self) -> int:
        return self.vocab * self.VALUES + self.vocab  # pair tokens, then query tokens

    @property
    def num_classes(self) -> int:
        return self.VALUES

    def inputs(self, gen: torch.Generator, n: int) -> torch.Tensor:
        P, queries = self.pairs, self.vocab * self.VALUES  # query token ids start here
        keys = torch.rand(n, self.vocab, generator=gen).argsort(dim=-1)[:, :P]  # (n, P) distinct
        values = torch.randint(0, self.VALUES, (n, P), generator=gen)  # (n, P)
        order = torch.rand(n, P, generator=gen).argsort(dim=-1)  # (n, P): which pair each asks
        return torch.cat([keys * self.VALUES + values, queries + keys.gather(1, order)], dim=1)

    def targets(self, x: torch.Tensor) -> torch.Tensor:
        P = self.pairs
        values = x[:, :P] % self.VALUES  # (B, P)
        match = self.alignment(x)[:, P:, :P]  # (B, P, P): query i asks pair j
        asked = match.long().argmax(dim=-1)  # (B, P)
        return torch.cat([torch.full_like(values, IGNORE), values.gather(1, asked)], dim=1)

    def alignment(self, x: torch.Tensor) -> torch.Tensor:
        P, T = self.pairs, self.length
        pair_keys = x[:, :P] // self.VALUES  # (B, P)
        query_keys = x[:, P:] - self.vocab * self.VALUES  # (B, P)
        out = torch.zeros(x.shape[0], T, T, dtype=torch.bool)
        out[:, P:, :P] = query_keys[:, :, None] == pair_keys[:, None, :]  # (B, P, P)
        return out

    def token(self, i: int) -> str:
        pair_tokens = self.vocab * self.VALUES
        if i < pair_tokens:
            return f"{_LETTERS[i // self.VALUES]}:{i % self.VALUES}"
        return f"{_LETTERS[i - pair_tokens]}?"

    def label(self, c: int) -> str:
        return str(c)


TASKS: dict[str, type[Task]] = {t.name: t for t in (Reverse, Sort, KVRecall)}


def make_task(name: str, *, length: int | None = None, vocab: int | None = None) -> Task:
    """The task called ``name`` (see :data:`TASKS`), with its default sizes unless given.

    >>> make_task("reverse")
    Reverse(length=16, vocab=16)
    """
    if name not in TASKS:
        raise AttentionInputError(
            "attnkit.train",
            "task",
            f"unknown task {name!r}.",
            got=f"task={name!r}",
            expected=f"one of {', '.join(TASKS)}",
            fix=f"pick one of {', '.join(TASKS)}",
        )
    sizes = {k: v for k, v in (("length", length), ("vocab", vocab)) if v is not None}
    return TASKS[name](**sizes)
