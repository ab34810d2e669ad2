"""What every entry point shares (the trainer, inference, the planner, the selftest, the
export and the evals), below all of them:

- **placement** (`_placement.py`): `Placement`, the devices, mesh and `ShardingSpec` of a
  run from parsed values, with the layouts of its model, optimizer state and batch;
  `default_mesh`, `device_grid`;
- **processes** (`_processes.py`, `_distributed.py`): `jax.distributed` with every wait
  bounded, fake CPU devices (`set_cpu_devices`), agreement between processes (`sync`,
  `agree`, ...), the peer watch, and how a process reports a fatal error (`_exit.py`);
- **run directories** (`_runs.py`, `_run_model.py`, `_checkpoints.py`, `_hf_source.py`,
  `_model_config.py`): the newest run, a run's recorded flags, its checkpoints read back,
  the model config its flags describe and its model;
- **the command-line conventions** (`_cli.py`): a parser whose errors are one line, the
  placement flags and `--override`.

It imports nothing of `train/`, `inference/` or `plan/`; they import it.
"""

from ._checkpoints import RESHARDABLE_MODEL_FIELDS as RESHARDABLE_MODEL_FIELDS
from ._checkpoints import TMP_RE as TMP_RE
from ._checkpoints import CheckpointReader as CheckpointReader
from ._checkpoints import abstract_of as abstract_of
from ._checkpoints import check_checkpoint_dir as check_checkpoint_dir
from ._checkpoints import check_meta_matches as check_meta_matches
from ._checkpoints import is_array_or_shape as is_array_or_shape
from ._checkpoints import is_step_dir as is_step_dir
from ._checkpoints import to_json as to_json
from ._checkpoints import unreadable_reason as unreadable_reason
from ._cli import DefaultsHelpFormatter as DefaultsHelpFormatter
from ._cli import Parser as Parser
from ._cli import UsageError as UsageError
from ._cli import add_placement_flags as add_placement_flags
from ._cli import fsdp_axes_of as fsdp_axes_of
from ._cli import mesh_shape as mesh_shape
from ._cli import mesh_text as mesh_text
from ._cli import parse_mesh as parse_mesh
from ._cli import parse_override as parse_override
from ._cli import placement_from_flags as placement_from_flags
from ._cli import positive_int as positive_int
from ._distributed import EXIT_PEER_LOST as EXIT_PEER_LOST
from ._distributed import PEER_TIMEOUT as PEER_TIMEOUT
from ._distributed import Cluster as Cluster
from ._distributed import PeerWatch as PeerWatch
from ._distributed import Runtime as Runtime
from ._distributed import cluster_from_flags as cluster_from_flags
from ._distributed import set_cpu_devices as set_cpu_devices
from ._distributed import start_processes as start_processes
from ._exit import EXIT_PREEMPTED as EXIT_PREEMPTED
from ._exit import die as die
from ._exit import error_line as error_line
from ._exit import exit_now as exit_now
from ._exit import preempted_line as preempted_line
from ._hf_source import CONFIG_FILE as CONFIG_FILE
from ._hf_source import SOURCE_COPY as SOURCE_COPY
from ._hf_source import SOURCE_EXTRAS as SOURCE_EXTRAS
from ._hf_source import HFStart as HFStart
from ._hf_source import hf_start as hf_start
from ._hf_source import run_model_config as run_model_config
from ._model_config import check_model_fits as check_model_fits
from ._model_config import coerce_override as coerce_override
from ._model_config import preset_model_config as preset_model_config
from ._model_config import resolve_overrides as resolve_overrides
from ._placement import MESH_AXES as MESH_AXES
from ._placement import Placement as Placement
from ._placement import bytes_on_device as bytes_on_device
from ._placement import check_device_count as check_device_count
from ._placement import default_mesh as default_mesh
from ._placement import device_grid as device_grid
from ._processes import INIT_TIMEOUT as INIT_TIMEOUT
from ._processes import agree as agree
from ._processes import all_readable as all_readable
from ._processes import is_primary as is_primary
from ._processes import primary_value as primary_value
from ._processes import sync as sync
from ._run_model import RunModel as RunModel
from ._run_model import read_run_model as read_run_model
from ._runs import FLAGS_FILE as FLAGS_FILE
from ._runs import default_run_dir as default_run_dir
from ._runs import read_flags as read_flags
from ._transplant import transplant as transplant
