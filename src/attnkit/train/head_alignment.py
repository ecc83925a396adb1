"""The attention maps of a trained model on one held-out sequence, and the alignment they show.

Dimension legend: N layers, H heads, T tokens (each map is T x T: rows are queries, columns keys).

Each task knows which key a query row should read (:meth:`Task.alignment`: the mirrored position
for ``reverse``, the position of the i-th smallest letter for ``sort``, the pair with the asked
key for ``kv_recall``). :func:`alignment_scores` measures, for every layer and head, in how many
of those rows the largest weight lands on a right key, and the mean weight the right keys get;
:func:`layer_scores` does the same for each layer's heads averaged (a task may spread one
alignment over several heads). :func:`write_maps` writes the maps with
:func:`attnkit.inspect.write_all` and reports both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from attnkit.train.task_model import TaskModel
from attnkit.train.tasks import IGNORE, Task

__all__ = ["HeadAlignment", "MapsReport", "alignment_scores", "layer_scores", "write_maps"]


@dataclass(frozen=True)
class HeadAlignment:
    """How one head (or a layer's heads averaged) follows the task's alignment on one sequence.

    ``hits`` of ``rows`` query rows (those with a right key) put their largest weight on a right
    key; ``mass`` is the mean total weight on the right keys over those rows.
    """

    layer: int
    head: int | None  # None: the mean of the layer's heads
    hits: int
    rows: int
    mass: float

    @property
    def fraction(self) -> float:
        return self.hits / self.rows if self.rows else 0.0


@dataclass(frozen=True)
class MapsReport:
    """The maps written for one held-out sequence and what they show."""

    paths: dict[str, Path]  # html, png, npz
    tokens: list[str]  # the input, as token names
    target: str  # the right output, as class names (``.`` where not scored)
    prediction: str  # the model's output
    correct: bool  # every scored position right
    alignment_name: str  # what a query row should attend to
    heads: tuple[HeadAlignment, ...]  # every layer and head, best first
    layers: tuple[HeadAlignment, ...]  # every layer, its heads averaged, best first

    @property
    def best(self) -> HeadAlignment:
        """The head that follows the alignment best."""
        return self.heads[0]

    @property
    def best_layer(self) -> HeadAlignment:
        """The layer whose mean over heads follows the alignment best (``head`` is None)."""
        return self.layers[0]


def alignment_scores(attentions: torch.Tensor, allowed: torch.Tensor) -> list[HeadAlignment]:
    """Score every head of ``attentions (N, H, T, T)`` against ``allowed`` bool ``(T, T)``
    (True where key j is a right source for query i); best first (by hits, then mass).

    >>> mirror = torch.eye(3, dtype=torch.bool).flip(-1)
    >>> maps = torch.stack([torch.eye(3), mirror.float()])[None]  # (N=1, H=2, T=3, T=3)
    >>> [(s.head, s.hits, s.rows) for s in alignment_scores(maps, mirror)]
    [(1, 3, 3), (0, 1, 3)]
    """
    rows = allowed.any(dim=-1)  # (T,): query rows that have a right key
    n_rows = int(rows.sum().item())
    top = attentions.argmax(dim=-1)  # (N, H, T)
    hit = allowed.gather(-1, top.reshape(-1, top.shape[-1]).T).T.reshape(top.shape)  # (N, H, T)
    mass = (attentions * allowed).sum(dim=-1)  # (N, H, T)
    scores = [
        HeadAlignment(
            layer=n,
            head=h,
            hits=int((hit[n, h] & rows).sum().item()),
            rows=n_rows,
            mass=float(mass[n, h][rows].mean().item()) if n_rows else 0.0,
        )
        for n in range(attentions.shape[0])
        for h in range(attentions.shape[1])
    ]
    return sorted(scores, key=lambda s: (-s.hits, -s.mass, s.layer, s.head or 0))


def layer_scores(attentions: torch.Tensor, allowed: torch.Tensor) -> list[HeadAlignment]:
    """:func:`alignment_scores` of each layer's mean over heads (``head=None``); best first.

    A task may spread one alignment over several heads (each serving some of the rows); the
    mean shows it whole.
    """
    mean = attentions.mean(dim=1, keepdim=True)  # (N, 1, T, T)
    return [replace(s, head=None) for s in alignment_scores(mean, allowed)]


@torch.no_grad()
def write_maps(
    task: Task, model: TaskModel, x: torch.Tensor, out: str | os.PathLike[str]
) -> MapsReport:
    """Run ``model`` on one sequence ``x (T,)`` with the weights and write its maps to ``out``.

    Writes ``attention.html``, ``attention.png`` and ``attention.npz`` (all layers and heads,
    ``(N, H, T, T)``, and the last hidden state ``(T, E)``).
    """
    from attnkit.inspect.maps import write_all

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    result = model(x[None].to(device), need_weights=True)
    model.train(was_training)
    if result.attentions is None:  # need_weights=True always returns them
        raise RuntimeError("the model returned no attention weights")
    attentions = torch.stack([a[0] for a in result.attentions]).float().cpu()  # (N, H, T, T)
    tokens = [task.token(int(i)) for i in x]
    y = task.targets(x[None].cpu())[0]  # (T,)
    pred = result.logits[0].argmax(dim=-1).cpu()  # (T,)
    scored = y != IGNORE
    pred_shown = torch.where(scored, pred, y)
    allowed = task.alignment(x[None].cpu())[0]  # (T, T)
    title = f"attnkit train: {task.name}, one held-out sequence"
    paths = write_all(out, attentions, tokens, result.hidden[0].float().cpu(), title=title)
    return MapsReport(
        paths=paths,
        tokens=tokens,
        target=task.describe_targets(y),
        prediction=task.describe_targets(pred_shown),
        correct=bool((pred[scored] == y[scored]).all().item()),
        alignment_name=task.alignment_name,
        heads=tuple(alignment_scores(attentions, allowed)),
        layers=tuple(layer_scores(attentions, allowed)),
    )
