"""The whole-step planner and its CLI, `python -m eqx_longctx.plan`: what a train step holds
on each device, for every strategy and remat policy, before it runs.

- `_step_plan.py`: `plan_train_step` and its `StepPlan` (the per-device breakdown, the
  choice of strategy and remat policy under a memory budget).
- `_activations.py`: what one layer saves for the backward pass, asked of JAX at the shapes
  one device computes with.
- `_explain.py`: the plan's table and JSON record.
- `_compile.py`: the check against XLA: one attention call, or the trainer's own step under
  the trainer's `Placement`, compiled for abstract arrays; `compiled_bytes` reads the
  memory analysis.
- `_cli.py`: the command line.

The model is known only through its `eqx_longctx.ModelFamily`; the per-call attention cost
model and chooser it builds on are `eqx_longctx.attention`'s (`choose_strategy`, `explain`).
"""

from ._cli import main as main
from ._compile import CompiledBytes as CompiledBytes
from ._compile import compiled_attention as compiled_attention
from ._compile import compiled_bytes as compiled_bytes
from ._compile import compiled_memory as compiled_memory
from ._step_plan import StepMemory as StepMemory
from ._step_plan import StepPlan as StepPlan
from ._step_plan import plan_train_step as plan_train_step

__all__ = [
    "CompiledBytes",
    "StepMemory",
    "StepPlan",
    "compiled_attention",
    "compiled_bytes",
    "compiled_memory",
    "main",
    "plan_train_step",
]
