"""The train check: three steps of the tiny Llama through the trainer `python -m
eqx_longctx.train` runs (`Trainer(TrainConfig(...))`), on every local device with the
default mesh, strategy and `impl="auto"`, into a temporary run directory."""

import contextlib
import io
import json
import math
import tempfile

import jax

from ._report import CheckFailed, Row, run_check

STEPS = 3
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def train_row(seq_len: int = 64, batch_size: int = 2) -> Row:
    """**Returns:** a row that passes when every step's loss is finite and the train step
    compiled at most once (later steps reuse it); whether the loss fell is noted."""
    from ..train import TrainConfig, Trainer

    devices = jax.device_count()
    label = f"train llama tiny {STEPS} steps b{batch_size} s{seq_len}"
    compiles: list[str] = []

    def listen(event: str, duration_secs: float, **kw: str | int) -> None:
        del duration_secs
        if event == _COMPILE_EVENT and kw.get("fun_name") == "jit(step)":
            compiles.append(event)

    def run():
        with tempfile.TemporaryDirectory(prefix="eqx-longctx-selftest-") as run_dir:
            config = TrainConfig(
                model="llama", preset="tiny", seq_len=seq_len, batch_size=batch_size,
                steps=STEPS, devices=devices, run_dir=run_dir, overwrite=True,
                max_bytes=200_000, eval_every=10 * STEPS, eval_batches=1,
                final_eval_batches=1, checkpoint_every=10 * STEPS, progress=False,
            )  # fmt: skip
            jax.monitoring.register_event_duration_secs_listener(listen)
            try:  # the table reports the run; its own lines (validation loss) stay out
                with contextlib.redirect_stdout(io.StringIO()):
                    trainer = Trainer(config)
                    result = trainer.run()
                    trainer.close()
            finally:
                jax.monitoring.unregister_event_duration_listener(listen)
            with open(result.metrics_path) as f:
                records = [json.loads(line) for line in f]
        losses = [r["loss"] for r in records if r.get("split") == "train"]
        text = f"loss {' '.join(f'{x:.3f}' for x in losses)}; step compiled {len(compiles)}x"
        if result.status != "completed" or len(losses) != STEPS:
            raise CheckFailed(f"status {result.status} after {len(losses)} logged steps", text)
        if not all(math.isfinite(x) for x in losses):
            raise CheckFailed("non-finite loss", text)
        if len(compiles) > 1:
            raise CheckFailed(f"the train step compiled {len(compiles)} times, not once", text)
        return text, "loss fell" if losses[-1] < losses[0] else "loss did not fall"

    return run_check(label, f"auto, {devices} devices", "finite", None, run)
