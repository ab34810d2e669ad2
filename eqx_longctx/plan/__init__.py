"""The whole-step planner and its CLI, `python -m eqx_longctx.plan`: what a train step holds
on each device, for every strategy and remat policy, before it runs; and what inference
holds (`--generate`).

- `_step_plan.py`: `plan_train_step` and its `StepPlan` (the per-device breakdown, the
  choice of strategy and remat policy under a memory budget).
- `_activations.py`: what one layer saves for the backward pass, asked of JAX at the shapes
  one device computes with.
- `_step_time.py`: the step's time (every layer's matmuls and attention), its model FLOPs
  and the MFU they imply; `_chips.py`: `Chip` and `CHIPS`, the accelerators' published
  FLOP/s, HBM and link bandwidth (`--chip`).
- `_explain.py`: the plan's table and JSON record.
- `_compile.py`: the check against XLA: one attention call, the trainer's own step under
  the trainer's `Placement`, or the prefill and decode step, compiled for abstract arrays;
  `compiled_bytes` reads the memory analysis.
- `_generate_plan.py`: `plan_generate` and its `GeneratePlan`: inference (the KV cache,
  the prefill and a decode step) per device; `_generate_cli.py` its `--generate` command.
- `_cli.py`: the command line.

The model is known only through its `eqx_longctx.ModelFamily`; the per-call attention cost
model and chooser it builds on are `eqx_longctx.attention`'s (`choose_strategy`, `explain`).
"""

from ._chips import CHIPS as CHIPS
from ._chips import Chip as Chip
from ._cli import main as main
from ._compile import CompiledBytes as CompiledBytes
from ._compile import compile_generate as compile_generate
from ._compile import compiled_attention as compiled_attention
from ._compile import compiled_bytes as compiled_bytes
from ._compile import compiled_memory as compiled_memory
from ._generate_plan import GenerateMemory as GenerateMemory
from ._generate_plan import GeneratePlan as GeneratePlan
from ._generate_plan import plan_generate as plan_generate
from ._step_plan import StepMemory as StepMemory
from ._step_plan import StepPlan as StepPlan
from ._step_plan import plan_train_step as plan_train_step

__all__ = [
    "CHIPS",
    "Chip",
    "CompiledBytes",
    "GenerateMemory",
    "GeneratePlan",
    "StepMemory",
    "StepPlan",
    "compile_generate",
    "compiled_attention",
    "compiled_bytes",
    "compiled_memory",
    "main",
    "plan_generate",
    "plan_train_step",
]
