"""attnkit.train: tasks and their split, checkpoints, resume, a real training run, its maps, DDP,
and what never loses a run: non-finite tensors and losses, overwriting, edited checkpoints.

The training runs use a tiny config (reversal of 8 letters, one layer of width 32) that reaches
the target in a few dozen steps, so the module runs in seconds apart from the DDP test, which
spends most of its time starting two Python processes.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attnkit.train.loop as loop
from attnkit import AttentionInputError
from attnkit.train import (
    CHECKPOINT_NAME,
    KVRecall,
    Progress,
    Reverse,
    Sort,
    Task,
    TrainConfig,
    TrainingDivergedError,
    TrainResult,
    alignment_scores,
    build,
    layer_scores,
    load_checkpoint,
    make_task,
    resume_config,
    save_checkpoint,
    train,
    verify_checkpoint,
)
from attnkit.train.checkpoint import read_info
from attnkit.train.loop import held_out_set, train_batch
from attnkit.train.tasks import HOLDOUT_EVERY, IGNORE
from checkpoints import edit_checkpoint

_st_torch = pytest.importorskip(
    "safetensors.torch",
    reason="safetensors is not installed (the inspect extra: pip install '.[inspect]')",
)
load_file, save_file = _st_torch.load_file, _st_torch.save_file

TINY = TrainConfig(
    task="reverse",
    length=8,
    vocab=8,
    dim=32,
    num_layers=1,
    num_heads=2,
    batch_size=64,
    lr=1e-2,
    warmup=10,
    steps=400,
    eval_every=10,
    eval_size=500,
    test_size=1000,
)


def _rows(x: torch.Tensor) -> set[tuple[int, ...]]:
    return {tuple(r) for r in x.tolist()}


# ---------------------------------------------------------------------------------------------
# tasks


def test_targets_are_right_for_every_task() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = Reverse(length=7, vocab=5).sample(gen, 50)
    assert all(ys == xs[::-1] for xs, ys in zip(x.tolist(), y.tolist(), strict=True))
    x, y = Sort(length=9, vocab=4).sample(gen, 50)
    assert all(ys == sorted(xs) for xs, ys in zip(x.tolist(), y.tolist(), strict=True))

    task = KVRecall(length=10, vocab=7)  # 5 pairs, 7 possible keys, values 0..7
    P, V = task.pairs, KVRecall.VALUES
    x, y = task.sample(gen, 50)
    assert int(x.max()) < task.vocab_size
    for xs, ys in zip(x.tolist(), y.tolist(), strict=True):
        pairs = {t // V: t % V for t in xs[:P]}
        assert len(pairs) == P  # distinct keys
        asked = [t - task.vocab * V for t in xs[P:]]
        assert sorted(asked) == sorted(pairs)  # every key asked once
        assert ys == [IGNORE] * P + [pairs[k] for k in asked]
    assert task.describe(x[0]).split()[P].endswith("?")


@pytest.mark.parametrize("task", [Reverse(), Sort(), KVRecall()], ids=lambda t: t.name)
def test_alignment_points_at_the_tokens_that_hold_the_answer(task: Task) -> None:
    x, y = task.sample(torch.Generator().manual_seed(1), 64)
    allowed = task.alignment(x)  # (B, T, T)
    scored = y != IGNORE
    assert torch.equal(allowed.any(dim=-1), scored)  # a right key for exactly the scored rows
    b, i, j = allowed.nonzero(as_tuple=True)
    source = x[b, j] % KVRecall.VALUES if isinstance(task, KVRecall) else x[b, j]
    assert torch.equal(source, y[b, i])


def test_held_out_split_is_disjoint_from_training_by_construction() -> None:
    config = TINY.resolved()
    task = config.make_task()
    train_x = torch.cat([train_batch(config, task, s)[0] for s in range(40)])  # (2560, T)
    eval_x, _ = held_out_set(config, task, test=False)
    test_x, test_y = held_out_set(config, task, test=True)
    assert not task.is_held_out(train_x).any()
    assert task.is_held_out(eval_x).all()
    assert task.is_held_out(test_x).all()
    assert not _rows(train_x) & (_rows(eval_x) | _rows(test_x))
    assert torch.equal(test_y, task.targets(test_x))
    # the split holds out about one sequence in HOLDOUT_EVERY of the whole space
    share = task.is_held_out(task.inputs(torch.Generator().manual_seed(2), 20_000)).float().mean()
    assert abs(share.item() - 1 / HOLDOUT_EVERY) < 0.01


def test_data_is_a_function_of_seed_and_step_and_ranks_shard_the_batch() -> None:
    config = TINY.resolved()
    task = config.make_task()
    x0, y0 = train_batch(config, task, 5)
    assert torch.equal(x0, train_batch(config, task, 5)[0])
    assert not torch.equal(x0, train_batch(config, task, 6)[0])
    other = dataclasses.replace(config, seed=1)
    assert not torch.equal(x0, train_batch(other, task, 5)[0])
    shards = [train_batch(config, task, 5, rank=r, world_size=4) for r in range(4)]
    assert torch.equal(torch.cat([s[0] for s in shards]), x0)
    assert torch.equal(torch.cat([s[1] for s in shards]), y0)


def test_bad_task_settings_are_refused_with_a_message() -> None:
    with pytest.raises(AttentionInputError, match="unknown task 'nope'") as e:
        make_task("nope")
    assert e.value.fix == "pick one of reverse, sort, kv_recall"
    with pytest.raises(AttentionInputError, match="must be even"):
        KVRecall(length=5)
    with pytest.raises(AttentionInputError, match="at least length / 2"):
        KVRecall(length=12, vocab=4)
    with pytest.raises(AttentionInputError, match=r"--num-heads must be a divisor of dim=30"):
        TrainConfig(dim=30, num_heads=4)
    with pytest.raises(AttentionInputError, match=r"--steps must be a positive int, got 0"):
        TrainConfig(steps=0)
    for lr in (0.0, float("inf"), float("nan"), 1e38):  # AdamW's first step is 10 x lr
        with pytest.raises(AttentionInputError, match=r"--lr must be a float > 0 and <= 3.4e37"):
            TrainConfig(lr=lr)
    with pytest.raises(AttentionInputError, match=r"--weight-decay must be a float >= 0"):
        TrainConfig(lr=1e37, weight_decay=1e3)


# ---------------------------------------------------------------------------------------------
# checkpoints


def _steps(config: TrainConfig, model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    task = config.make_task()
    for step in range(n):
        x, y = train_batch(config, task, step)
        loss = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        opt.zero_grad()
        torch.autograd.backward(loss)
        opt.step()


def test_checkpoint_round_trip_is_bit_exact(tmp_path: Path) -> None:
    config = TINY.resolved()
    _, model, opt = build(config)
    _steps(config, model, opt, 3)
    path = save_checkpoint(
        tmp_path / CHECKPOINT_NAME,
        model,
        opt,
        step=3,
        finished=False,
        config=dataclasses.asdict(config),
    )
    _, loaded, loaded_opt = build(dataclasses.replace(config, seed=7))  # other weights, no state
    info = load_checkpoint(path, loaded, loaded_opt)
    assert (info.step, info.finished, TrainConfig(**info.config)) == (3, False, config)
    assert resume_config(tmp_path) == config

    ours, theirs = model.state_dict(), loaded.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    a, b = opt.state_dict(), loaded_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    assert len(a["state"]) == len(ours)
    for index, state in a["state"].items():
        assert state.keys() == b["state"][index].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(state[k], b["state"][index][k]) for k in state)

    _steps(config, model, opt, 2)  # and both go on identically
    _steps(config, loaded, loaded_opt, 2)
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), loaded.parameters(), strict=True)
    )


def test_loading_something_else_says_what_is_wrong(tmp_path: Path) -> None:
    _, model, opt = build(TINY.resolved())
    with pytest.raises(AttentionInputError, match="there is no checkpoint at") as e:
        load_checkpoint(tmp_path / "missing.safetensors", model, opt)
    assert "without --resume" in (e.value.fix or "")
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(other), metadata={"format": "something"})
    with pytest.raises(AttentionInputError, match="not an attnkit train checkpoint"):
        load_checkpoint(other, model, opt)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file at all")
    with pytest.raises(AttentionInputError, match="not a readable safetensors file"):
        load_checkpoint(garbage, model, opt)
    bigger = TINY.resolved()
    _, small, small_opt = build(bigger)
    path = save_checkpoint(
        tmp_path / CHECKPOINT_NAME, small, small_opt, step=0, finished=False, config={}
    )
    _, wide, _ = build(dataclasses.replace(bigger, dim=64))
    with pytest.raises(AttentionInputError, match="does not fit this model"):
        load_checkpoint(path, wide)


# ---------------------------------------------------------------------------------------------
# resume


def test_resume_continues_bit_for_bit(tmp_path: Path) -> None:
    config = dataclasses.replace(TINY, steps=12, target=None, checkpoint_every=5)
    straight = train(config, tmp_path / "straight")
    first = train(config, tmp_path / "split", stop_at=7)
    assert first.fit.stopped
    assert first.fit.step == 7
    assert first.test is None
    second = train(config, tmp_path / "split", resume=True)
    assert (second.fit.start_step, second.fit.step, second.fit.finished) == (7, 12, True)
    assert straight.fit.step == 12
    assert not straight.fit.reached_target

    a = load_file(str(straight.checkpoint))
    b = load_file(str(second.checkpoint))
    assert a.keys() == b.keys()
    assert any(k.startswith("optim.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert straight.test == second.test


def test_resume_refuses_a_different_run(tmp_path: Path) -> None:
    with pytest.raises(AttentionInputError, match="there is no checkpoint"):
        train(TINY, tmp_path, resume=True)
    config = dataclasses.replace(TINY, steps=3, target=None)
    train(config, tmp_path, stop_at=2)
    with pytest.raises(AttentionInputError, match=r"has steps=3, but steps=5 was asked") as e:
        train(dataclasses.replace(config, steps=5), tmp_path, resume=True)
    assert e.value.fix == "leave out --steps, or start a new run without --resume"


def test_runtime_arguments_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    with pytest.raises(AttentionInputError, match="does not divide the batch of 64") as e:
        train(TINY, tmp_path, world_size=3)
    assert e.value.fix == "use --ddp 2 or 4 or 8"
    with pytest.raises(AttentionInputError, match=r"--ddp 16 is more processes than") as e:
        train(TINY, tmp_path, world_size=16)
    assert "at most 8 (one per CPU core, os.cpu_count() = 8)" in e.value.problem
    assert e.value.fix == "pass --ddp 8 or fewer"
    with pytest.raises(AttentionInputError, match="unknown device 'gpu0'"):
        train(TINY, tmp_path, device="gpu0")
    with pytest.raises(AttentionInputError, match="--ddp runs on the CPU"):
        train(TINY, tmp_path, device="cuda", world_size=2)
    with pytest.raises(AttentionInputError, match="--threads must be a positive int"):
        train(TINY, tmp_path, threads=0)
    with pytest.raises(AttentionInputError, match="--stop-at must be a positive int"):
        train(TINY, tmp_path, stop_at=0)
    assert not (tmp_path / CHECKPOINT_NAME).exists()


# ---------------------------------------------------------------------------------------------
# a real training run, and its maps


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainResult, list[Progress]]:
    reports: list[Progress] = []
    result = train(TINY, tmp_path_factory.mktemp("tiny"), progress=reports.append)
    return result, reports


def test_training_reaches_the_target_on_held_out_sequences(
    trained: tuple[TrainResult, list[Progress]],
) -> None:
    result, reports = trained
    fit = result.fit
    assert fit.reached_target
    assert fit.finished
    assert not fit.stopped
    assert fit.step < TINY.steps  # stopped early, at an evaluation
    assert fit.step % TINY.eval_every == 0
    assert result.test is not None
    assert result.test.size == TINY.test_size
    assert result.test.sequence >= 0.99
    assert result.test.token >= 0.99
    assert [p.step for p in reports] == list(range(fit.step + 1))
    assert reports[0].loss is None
    losses = [p.loss for p in reports[1:] if p.loss is not None]
    assert losses[-1] < 0.1 * losses[0]  # the live loss went down
    evaluated = [p for p in reports if p.held_out is not None]
    assert [p.step for p in evaluated] == list(range(10, fit.step + 1, 10))
    assert evaluated[-1].held_out == fit.held_out


def test_maps_show_the_anti_diagonal(trained: tuple[TrainResult, list[Progress]]) -> None:
    result, _ = trained
    assert result.maps is not None
    maps = result.maps
    assert sorted(p.name for p in maps.paths.values()) == [
        "attention.html",
        "attention.npz",
        "attention.png",
    ]
    with np.load(maps.paths["npz"], allow_pickle=False) as data:
        attentions = data["attentions"]  # (N, H, T, T)
        tokens = list(data["tokens"])
    assert attentions.shape == (TINY.num_layers, TINY.num_heads, 8, 8)  # (N, H, T, T)
    T = attentions.shape[-1]
    assert tokens == maps.tokens
    mirrored = T - 1 - np.arange(T)
    hits = (attentions.argmax(axis=-1) == mirrored).sum(axis=-1)  # (N, H)
    assert hits.max() >= 0.8 * T, hits  # some head reads the mirrored position in most rows
    assert maps.best_layer.head is None
    assert maps.best_layer.hits >= 0.8 * T
    best = maps.best
    assert best.hits == hits.max()
    assert hits[best.layer, best.head] == best.hits
    assert maps.correct
    assert maps.prediction == maps.target == " ".join(reversed(maps.tokens))


def test_alignment_scores_rank_heads() -> None:
    T = 5
    mirror = torch.eye(T, dtype=torch.bool).flip(-1)
    uniform = torch.full((T, T), 1 / T)
    maps = torch.stack([torch.eye(T), uniform, 0.9 * mirror + 0.02])[None]  # (1, 3, T, T)
    scores = alignment_scores(maps, mirror)
    assert [(s.head, s.hits, s.rows) for s in scores] == [(2, 5, 5), (0, 1, 5), (1, 1, 5)]
    assert scores[0].mass == pytest.approx(0.92)
    assert scores[0].fraction == 1.0
    # two heads that each serve half of the rows: the layer's mean shows the whole alignment
    T = 6
    mirror = torch.eye(T, dtype=torch.bool).flip(-1)
    wrong = 0.4 * torch.eye(T) + 0.12 * (1 - torch.eye(T))  # rows sum to 1, argmax off
    first = (torch.arange(T) < 3)[:, None]  # (T, 1)
    split = torch.stack([torch.where(first, mirror, wrong), torch.where(first, wrong, mirror)])
    assert [s.hits for s in alignment_scores(split[None], mirror)] == [3, 3]
    (layer,) = layer_scores(split[None], mirror)
    assert (layer.layer, layer.head, layer.hits, layer.rows) == (0, None, 6, 6)


# ---------------------------------------------------------------------------------------------
# DDP


def test_ddp_two_processes_follow_one_process(
    tmp_path: Path, trained: tuple[TrainResult, list[Progress]]
) -> None:
    """Two ranks on half batches: the same losses as one process, the same accuracy."""
    single, single_reports = trained
    reports: list[Progress] = []
    ddp = train(TINY, tmp_path, world_size=2, progress=reports.append)
    assert ddp.world_size == 2
    assert [p.step for p in reports] == list(range(ddp.fit.step + 1))
    # the loss of step s is that of the global batch with the parameters after s - 1 steps:
    # equal to one process up to rounding, which only grows slowly
    ours = np.array([p.loss for p in reports[1:6]])
    theirs = np.array([p.loss for p in single_reports[1:6]])
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)
    assert ddp.fit.reached_target
    assert ddp.fit.step == single.fit.step
    assert ddp.test is not None
    assert single.test is not None
    assert ddp.test.sequence >= 0.99
    assert abs(ddp.test.sequence - single.test.sequence) <= 0.005
    saved = load_file(str(ddp.checkpoint))
    assert any(k.startswith("optim.") for k in saved)  # rank 0 wrote the whole state


# ---------------------------------------------------------------------------------------------
# never losing a run


def _a_checkpoint(out: Path, steps: int = 2) -> Path:
    """A real run of ``steps`` steps in ``out``, stopped there (a checkpoint, no maps)."""
    train(dataclasses.replace(TINY, steps=10, target=None), out, stop_at=steps)
    return out / CHECKPOINT_NAME


def _first_weight(path: Path) -> str:
    return sorted(k for k in load_file(str(path)) if k.startswith("model."))[0]


def test_a_non_finite_tensor_is_refused_on_load_naming_it(tmp_path: Path) -> None:
    path = _a_checkpoint(tmp_path)
    name = _first_weight(path)
    edit_checkpoint(path, nan_in=name)
    damaged = path.read_bytes()
    _, model, opt = build(TINY.resolved())
    for load in (
        lambda: load_checkpoint(path, model, opt),
        lambda: verify_checkpoint(path),
        lambda: train(dataclasses.replace(TINY, steps=10, target=None), tmp_path, resume=True),
    ):
        with pytest.raises(AttentionInputError, match="holds 1 NaN and 0 inf") as e:
            load()
        assert f"tensor {name} (" in e.value.problem
        assert e.value.fix == "resume from an intact copy, or start a new run with --overwrite"
    assert path.read_bytes() == damaged  # refused before anything was written


def test_save_refuses_non_finite_tensors_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    path = _a_checkpoint(tmp_path)
    good = path.read_bytes()
    _, model, opt = build(TINY.resolved())
    load_checkpoint(path, model, opt)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    with pytest.raises(AttentionInputError, match=r"holds 0 NaN and 1 inf .* was not written"):
        save_checkpoint(path, model, opt, step=3, finished=False, config={})
    assert path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_NAME]


def test_the_first_non_finite_loss_stops_training_keeping_the_last_checkpoint(
    tmp_path: Path,
) -> None:
    config = dataclasses.replace(TINY, lr=1e6, warmup=1, clip=None, checkpoint_every=1)
    with pytest.raises(TrainingDivergedError) as e:
        train(config, tmp_path)
    assert (e.value.step, e.value.checkpoint_step) == (2, 1)
    assert str(e.value) == (
        f"training stopped at step 2 of 400: the training loss is nan; nothing of that step was "
        f"saved, the checkpoint of step 1 in {tmp_path} is the last good one (--resume "
        "continues it). A lower learning rate or another --seed usually avoids it."
    )
    assert verify_checkpoint(tmp_path / CHECKPOINT_NAME).step == 1  # finite, step 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_NAME]  # no maps, no .tmp


def test_weights_that_became_non_finite_are_never_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lr_at = loop.lr_at  # an infinite learning rate at the 4th step: the loss is still finite
    monkeypatch.setattr(loop, "lr_at", lambda c, s: float("inf") if s == 3 else lr_at(c, s))
    with pytest.raises(TrainingDivergedError, match=r"parameter \S+ became NaN or infinite") as e:
        train(dataclasses.replace(TINY, checkpoint_every=2), tmp_path)
    assert (e.value.step, e.value.checkpoint_step) == (4, 2)
    assert verify_checkpoint(tmp_path / CHECKPOINT_NAME).step == 2
    with pytest.raises(TrainingDivergedError, match="this run wrote no checkpoint"):
        train(dataclasses.replace(TINY, checkpoint_every=100), tmp_path / "fresh")
    assert not (tmp_path / "fresh" / CHECKPOINT_NAME).exists()


def test_a_run_is_never_overwritten_without_resume_or_overwrite(tmp_path: Path) -> None:
    path = _a_checkpoint(tmp_path)
    before = path.read_bytes()
    config = dataclasses.replace(TINY, steps=10, target=None)
    with pytest.raises(AttentionInputError, match="already holds a run's checkpoint") as e:
        train(config, tmp_path, stop_at=1)
    assert f"--out {tmp_path} already holds a run's checkpoint (step 2); a new run would " in str(
        e.value
    )
    assert e.value.fix == (
        "pass --resume to continue that run, or --overwrite to start a new run over it"
    )
    with pytest.raises(AttentionInputError, match="--resume continues the run in --out and"):
        train(config, tmp_path, resume=True, overwrite=True)
    assert path.read_bytes() == before
    other = dataclasses.replace(config, seed=1)
    train(other, tmp_path, overwrite=True, stop_at=1)
    assert read_info(path).step == 1
    assert read_info(path).config["seed"] == 1


def test_a_stale_tmp_file_is_removed_by_the_next_save_or_load(tmp_path: Path) -> None:
    path = _a_checkpoint(tmp_path)
    stale = tmp_path / (CHECKPOINT_NAME + ".tmp")
    _, model, opt = build(TINY.resolved())
    for use in (
        lambda: load_checkpoint(path, model, opt),
        lambda: verify_checkpoint(path),
        lambda: save_checkpoint(path, model, opt, step=0, finished=False, config={}),
    ):
        stale.write_bytes(b"half of a checkpoint: the save was killed")
        use()
        assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_NAME]


EDITS = [
    ({"step": "ten"}, "field 'step' is 'ten', not a number of steps (an int >= 0)"),
    ({"step": "-3"}, "field 'step' is '-3', not a number of steps"),
    ({"finished": "maybe"}, "field 'finished' is 'maybe', not true or false"),
    ({"config": "{"}, "field 'config' is '{', not a JSON object of settings"),
    ({"config": "[1, 2]"}, "field 'config' is '[1, 2]', not a JSON object"),
    ({"optim.param_groups": "{}"}, "field 'optim.param_groups' is '{}', not a JSON list"),
    ({"optim.scalars": '{"x": 1}'}, """field 'optim.scalars' is '{"x": 1}', not a JSON object"""),
    ({"config": '{"steps": 10, "bogus": 1}'}, "stored settings are not a valid run (TypeError: "),
    ({"config": '{"steps": 0}'}, "not a valid run (--steps must be a positive int, got 0.)"),
    ({"config": '{"task": "nope"}'}, "not a valid run (unknown task 'nope'.)"),
    ({"step": "99"}, "not a valid run (ValueError: step 99 is past the run's 10 steps)"),
]


@pytest.mark.parametrize(("edit", "message"), EDITS, ids=[str(e) for e, _ in EDITS])
def test_edited_metadata_is_refused_with_what_is_wrong(
    edit: dict[str, str], message: str, tmp_path: Path
) -> None:
    path = _a_checkpoint(tmp_path)
    edit_checkpoint(path, **edit)
    with pytest.raises(AttentionInputError) as e:
        resume_config(tmp_path)
    assert message in e.value.problem, e.value.problem
    assert "edited or damaged" in e.value.problem
    assert e.value.fix == "resume from an intact copy, or start a new run with --overwrite"


def test_a_missing_field_or_a_bad_optimizer_state_is_refused(tmp_path: Path) -> None:
    path = _a_checkpoint(tmp_path)
    edit_checkpoint(path, drop="finished")
    with pytest.raises(AttentionInputError, match="field 'finished' is missing, not true or"):
        read_info(path)
    path = _a_checkpoint(tmp_path / "groups")
    edit_checkpoint(path, **{"optim.param_groups": "[]"})
    _, model, opt = build(TINY.resolved())
    with pytest.raises(AttentionInputError, match="optimizer state does not fit this optimizer"):
        load_checkpoint(path, model, opt)


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("", "--out is empty."),
        ("{file}", "--out {file} is a file, not a directory."),
        ("{file}/run", "--out {file}/run cannot be created: {file} is a file."),
        ("{locked}/run", "--out {locked}/run cannot be written: {locked}: "),
    ],
)
def test_an_unusable_out_is_refused_before_any_work(out: str, message: str, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("a file")
    where = {"file": str(tmp_path / "file"), "locked": str(_unwritable_dir(tmp_path))}
    with pytest.raises(AttentionInputError) as e:
        train(TINY, out.format(**where))
    assert message.format(**where) in e.value.problem
    assert e.value.argument == "out"


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot write into (root writes everywhere but sysfs)."""
    if os.geteuid() == 0:
        return Path("/sys")
    locked = tmp_path / "locked"
    locked.mkdir(exist_ok=True)
    locked.chmod(0o500)
    return locked


def test_a_ddp_run_that_diverges_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    config = dataclasses.replace(TINY, lr=1e6, warmup=1, clip=None, checkpoint_every=1)
    with pytest.raises(TrainingDivergedError, match="the training loss is nan") as e:
        train(config, tmp_path, world_size=2)
    assert (e.value.step, e.value.checkpoint_step) == (2, 1)
    assert verify_checkpoint(tmp_path / CHECKPOINT_NAME).step == 1


@pytest.mark.parametrize("flags", [{}, {"overwrite": True}, {"resume": True}])
def test_a_checkpoint_path_that_is_a_directory_is_refused_before_any_work(
    flags: dict[str, bool], tmp_path: Path
) -> None:
    """--out/checkpoint.safetensors a directory: the run would train, then fail to write its
    checkpoint (IsADirectoryError after all the work); each flag said something else."""
    (tmp_path / CHECKPOINT_NAME).mkdir()
    with pytest.raises(AttentionInputError) as e:
        train(TINY, tmp_path, **flags)
    assert e.value.argument == "out"
    assert f"{tmp_path / CHECKPOINT_NAME} is there but is not a file" in e.value.problem
    assert not any(p.name != CHECKPOINT_NAME for p in tmp_path.iterdir())  # nothing written


def test_loading_a_run_directory_names_its_checkpoint(tmp_path: Path) -> None:
    path = _a_checkpoint(tmp_path / "run")
    _, model, opt = build(TINY.resolved())
    with pytest.raises(AttentionInputError, match="is a run's directory, not its checkpoint") as e:
        load_checkpoint(path.parent, model, opt)
    assert f"pass {path}" in str(e.value)
