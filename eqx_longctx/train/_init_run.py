"""A run that starts from another run's weights (`--init-run DIR`): the long stage of a
short-then-long schedule (context extension), or any continuation with new data, length or
schedule."""

import pathlib
from typing import Any


def weights_of_run(run_dir: Any, placement: Any, abstract_model: Any, model: str) -> Any:
    """This run's model holding the weights of `run_dir`'s newest readable checkpoint.

    **Arguments:**

    - `run_dir`: a run of `python -m eqx_longctx.train` (its model and tokenizer are the
      byte-level ones of a fresh model, not an `--init-hf` start).
    - `placement`: this run's `eqx_longctx.run.Placement`; the weights are read straight
      into its shards.
    - `abstract_model`: this run's model as shapes (`Placement.abstract_model`): its
      structure and config (`max_seq_len`, `rope_theta`, ...) are kept.
    - `model`: this run's `--model`.

    **Returns:** the model, its arrays the checkpoint's.

    **Raises:** `ValueError` naming `--init-run` for a directory without a readable
    checkpoint, a run of another model family or one started from a Hugging Face
    checkpoint, and a weight whose shape or dtype differs from this run's model.
    """
    from ..run import read_run_model, transplant

    what = f"--init-run {run_dir}"
    try:
        run = read_run_model(pathlib.Path(run_dir), lambda c, f: placement, reader="--init-run")
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from e
    if run.flags["model"] != model:
        raise ValueError(
            f"{what} is a run of --model {run.flags['model']}, this run trains --model "
            f"{model}. Pass --model {run.flags['model']}, or another --init-run."
        )
    if run.start is not None:
        raise ValueError(
            f"{what} was started from the Hugging Face checkpoint {run.flags.get('init_hf')} "
            "and keeps its tokenizer; export it (python -m eqx_longctx.export) and pass the "
            "export as --init-hf instead."
        )
    return transplant(run.model, abstract_model, what=what)
