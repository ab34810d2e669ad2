"""The eval a recipe ends with: its retrieval task on the model just trained, at the
training length, under the run's own placement."""

import time
from typing import Any

from ._recipes import Recipe


def recipe_eval(recipe: Recipe, trainer: Any, *, progress: bool = True) -> dict[str, Any]:
    """Run `recipe.eval_task` on `trainer.model` at `seq_len - 1` tokens (BOS, prompt and
    answer: a training document's length with its EOS left out) over
    `recipe.eval_depths`, write its files to `RUN_DIR/eval` (as `python -m
    eqx_longctx.eval` does) and print the accuracy per depth and the wall time.

    **Returns:** the eval's results (`eqx_longctx.evals.evaluate_and_write`'s).
    """
    from ..evals import EvalModel, evaluate_and_write

    assert recipe.eval_task is not None
    tok = trainer.tokenizer
    em = EvalModel(
        trainer.model, tok, (int(tok.bos_id),), frozenset({int(tok.eos_id)}),
        name=f"{recipe.name} recipe, {trainer.config.model}",
    )  # fmt: skip
    # A training document is BOS, at most seq_len - 2 tokens, EOS: the eval's prompt and
    # answer (after BOS) take seq_len - 2 tokens, so the answer ends where training ones do.
    length = trainer.config.seq_len - 1
    print(f"{recipe.eval_task} eval at {length} tokens ({recipe.eval_samples} samples per "
          f"depth, {trainer.parallel.describe()}):", flush=True)  # fmt: skip
    start = time.perf_counter()
    result = evaluate_and_write(
        em, trainer.run_dir / "eval", tasks=[recipe.eval_task], lengths=[length],
        depths=recipe.eval_depths, samples=recipe.eval_samples, seed=trainer.config.seed + 1,
        progress=progress and trainer.config.progress,
    )  # fmt: skip
    print(f"eval wall time {time.perf_counter() - start:.0f} s", flush=True)
    return result
