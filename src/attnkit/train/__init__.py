"""Train a small attnkit transformer end to end on a task that needs attention (``attnkit train``).

- :mod:`~attnkit.train.tasks`: the tasks (``reverse``, ``sort``, ``kv_recall``), their seeded data
  and a held-out split that is disjoint from training by construction.
- :mod:`~attnkit.train.task_model`: embeddings + :class:`attnkit.modules.TransformerStack` + a head.
- :mod:`~attnkit.train.loop`: AdamW, evaluation, early stop, resume.
- :mod:`~attnkit.train.ddp`: ``--ddp N``, DistributedDataParallel over gloo.
- :mod:`~attnkit.train.checkpoint`: safetensors checkpoints of the model and the optimizer.
- :mod:`~attnkit.train.guards`: what a run refuses before it starts, and how it stops (a
  non-finite loss, Ctrl-C) without losing its last good checkpoint.
- :mod:`~attnkit.train.head_alignment`: the trained model's attention maps and the alignment
  they show.
"""

from attnkit.train.checkpoint import (
    CHECKPOINT_NAME,
    CheckpointInfo,
    UncheckedCheckpointWarning,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from attnkit.train.ddp import DistributedTrainingError
from attnkit.train.guards import TrainingDivergedError, max_processes
from attnkit.train.head_alignment import (
    HeadAlignment,
    MapsReport,
    alignment_scores,
    layer_scores,
    write_maps,
)
from attnkit.train.loop import (
    FitSummary,
    Progress,
    RunOptions,
    TrainConfig,
    TrainResult,
    build,
    evaluate,
    fit,
    resume_config,
    train,
)
from attnkit.train.task_model import ModelConfig, ModelOutput, TaskModel
from attnkit.train.tasks import TASKS, Accuracy, KVRecall, Reverse, Sort, Task, make_task

__all__ = [
    "CHECKPOINT_NAME",
    "TASKS",
    "Accuracy",
    "CheckpointInfo",
    "DistributedTrainingError",
    "FitSummary",
    "HeadAlignment",
    "KVRecall",
    "MapsReport",
    "ModelConfig",
    "ModelOutput",
    "Progress",
    "Reverse",
    "RunOptions",
    "Sort",
    "Task",
    "TaskModel",
    "TrainConfig",
    "TrainResult",
    "TrainingDivergedError",
    "UncheckedCheckpointWarning",
    "alignment_scores",
    "build",
    "evaluate",
    "fit",
    "layer_scores",
    "load_checkpoint",
    "make_task",
    "max_processes",
    "resume_config",
    "save_checkpoint",
    "train",
    "verify_checkpoint",
    "write_maps",
]
