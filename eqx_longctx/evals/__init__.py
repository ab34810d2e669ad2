"""Long-context evals: does a model use its context?

Synthetic retrieval tasks generated from a seed at any length and depth (`passkey`, the
RULER-style `niah_*` needles, `variable_tracking`, `mqar`), scored by exact match of the
greedy answer and drawn as depth x length heatmaps, and `position_loss`, the mean loss by
position over held-out text. `python -m eqx_longctx.eval` runs them on a training run or a
Hugging Face checkpoint, prefilling long prompts under the placement flags (any strategy
and layout); `--check-strategies` reruns them under every strategy and layout and fails
unless the greedy outputs are identical.
"""

from ._cli import ALL_TASKS as ALL_TASKS
from ._cli import main as eval_main
from ._load import rope_scaling_of as rope_scaling_of
from ._load import with_overrides as with_overrides
from ._mix import mix_datasets as mix_datasets
from ._mix import retrieval_dataset as retrieval_dataset
from ._mix import retrieval_rows_for as retrieval_rows_for
from ._mix import stream_mix as stream_mix
from ._mix import with_retrieval as with_retrieval
from ._plots import plot_heatmap as plot_heatmap
from ._plots import plot_position_loss as plot_position_loss
from ._position import position_loss as position_loss
from ._report import check_strategies as check_strategies
from ._report import evaluate_and_write as evaluate_and_write
from ._runner import EvalModel as EvalModel
from ._runner import accuracy_table as accuracy_table
from ._runner import generate_answers as generate_answers
from ._runner import run_samples as run_samples
from ._runner import task_samples as task_samples
from ._score import score as score
from ._tasks import TASKS as TASKS
from ._tasks import Sample as Sample
from ._tasks import make_drill as make_drill
from ._tasks import make_sample as make_sample
from ._tasks import make_samples as make_samples
from ._tasks import min_drill_length as min_drill_length
from ._tasks import min_length as min_length
from ._tasks import training_document as training_document

__all__ = [
    "ALL_TASKS",
    "EvalModel",
    "Sample",
    "TASKS",
    "accuracy_table",
    "check_strategies",
    "eval_main",
    "evaluate_and_write",
    "generate_answers",
    "make_drill",
    "make_sample",
    "make_samples",
    "mix_datasets",
    "min_drill_length",
    "min_length",
    "plot_heatmap",
    "plot_position_loss",
    "position_loss",
    "retrieval_dataset",
    "retrieval_rows_for",
    "rope_scaling_of",
    "run_samples",
    "score",
    "stream_mix",
    "task_samples",
    "training_document",
    "with_overrides",
    "with_retrieval",
]
