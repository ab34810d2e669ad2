"""Training: a functional train step, a resumable loop, orbax checkpoints and a CLI.

`python -m eqx_longctx.train` (or `eqx-longctx-train`) trains the tiny Llama on the Python
standard library in a few minutes on a laptop CPU; `--model deepseek` trains the tiny
DeepSeek (MLA + MoE), `--model NAME` any family installed as a plugin (see
`eqx_longctx.ModelFamily`), and `--mesh fsdp=2,context=4` splits every weight and the
optimizer state over the fsdp axis. Library use:

```python
trainer = Trainer(TrainConfig(model="llama", steps=200, run_dir="runs/demo"))
result = trainer.run()
print(result.summary())
```
"""

from ._checkpoint import Checkpointer as Checkpointer
from ._checkpoint import check_checkpoint_dir as check_checkpoint_dir
from ._config import TrainConfig as TrainConfig
from ._config import build_model_config as build_model_config
from ._eval import check_batch as check_batch
from ._eval import evaluate as evaluate
from ._export import export_run as export_run
from ._export import main as export_main
from ._loop import Trainer as Trainer
from ._metrics import MetricsLog as MetricsLog
from ._metrics import TrainResult as TrainResult
from ._metrics import plot_metrics as plot_metrics
from ._offload import HOST_OFFLOADS as HOST_OFFLOADS
from ._offload import check_host_offload as check_host_offload
from ._offload import host_offload_of as host_offload_of
from ._offload import to_device as to_device
from ._offload import to_host as to_host
from ._step import decay_mask as decay_mask
from ._step import loss_fn as loss_fn
from ._step import loss_sum as loss_sum
from ._step import lower_train_step as lower_train_step
from ._step import make_optimizer as make_optimizer
from ._step import make_schedule as make_schedule
from ._step import make_train_step as make_train_step
from ._step import micro_batches as micro_batches

__all__ = [
    "HOST_OFFLOADS",
    "Checkpointer",
    "MetricsLog",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "build_model_config",
    "check_batch",
    "check_checkpoint_dir",
    "decay_mask",
    "evaluate",
    "export_main",
    "export_run",
    "check_host_offload",
    "host_offload_of",
    "lower_train_step",
    "loss_fn",
    "loss_sum",
    "make_optimizer",
    "make_schedule",
    "make_train_step",
    "micro_batches",
    "plot_metrics",
    "to_device",
    "to_host",
]
