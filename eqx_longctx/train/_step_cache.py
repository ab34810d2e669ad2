"""The trainer's compiled step, kept across Trainers: one jitted function per run settings
that change what it compiles to, so a fresh Trainer (a resume in the same process, a test)
reuses it."""

import hashlib
from typing import Any

import jax

from .._caches import on_clear_caches
from ..run import Placement
from ._config import TrainConfig
from ._offload import host_offload_of
from ._step import make_optimizer, make_train_step

_STEP_CACHE: dict[tuple, tuple[Any, Any]] = {}
on_clear_caches(_STEP_CACHE.clear)


def cached_train_step(
    config: TrainConfig, model_config, parallel: Placement, model, tokenizer: Any = None
):
    """The optimizer and jitted train step of a run: one function object per (optimizer
    settings, model config, sharding spec, tokenizer's byte counts), so fresh Trainers
    reuse the compiled step."""
    warmup = config.warmup_steps or 0  # TrainConfig resolved None
    settings = (config.lr, warmup, config.steps, config.weight_decay, config.clip_norm)
    offload = host_offload_of(config.host_offload)
    counts = getattr(tokenizer, "token_bytes", None)
    counts = None if counts is None else hashlib.sha256(counts.tobytes()).hexdigest()
    key = (
        settings, model_config, parallel.spec, config.grad_accum, config.loss_chunk, offload,
        counts,
    )  # fmt: skip
    if key not in _STEP_CACHE:
        optimizer = make_optimizer(*settings)
        shardings = None
        if parallel.spec is not None:
            shardings = (
                parallel.param_shardings(model),
                parallel.opt_state_shardings(optimizer, model),
            )
        kwargs = {} if tokenizer is None else {"tokenizer": tokenizer}
        step = make_train_step(
            optimizer, shardings=shardings, donate=_donates(), grad_accum=config.grad_accum,
            loss_chunk=config.loss_chunk, host_offload=offload, **kwargs,
        )  # fmt: skip
        while len(_STEP_CACHE) >= 8:
            _STEP_CACHE.pop(next(iter(_STEP_CACHE)))
        _STEP_CACHE[key] = (optimizer, step)
    return _STEP_CACHE[key]


def _donates() -> bool:
    """Whether the trainer's step donates the model and optimizer state: on an accelerator,
    so that they are not held twice in its memory; not on CPU, where they live in host
    memory and donating them made the main job's step 15-25% slower (0.88 / 0.91 s against
    0.76 / 0.70 s per step, alternated; the donation came in with the sharded trainer and
    was the step-time regression of issue 19)."""
    return jax.devices()[0].platform != "cpu"
