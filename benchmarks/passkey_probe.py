"""How fast a tiny Llama learns pass key retrieval, on one device: the probe behind the
tables of docs/recipes.md.

Trains on retrieval rows only (`eqx_longctx.evals.retrieval_dataset`, loss on the answers
and their EOS), AdamW with the trainer's schedule, and every `--every` steps prints the
greedy exact match (teacher-forced, which equals greedy decoding for an answer that is
all right) by needle depth on 40 eval prompts (`make_sample`, half at `--seq - 1`
tokens, half up to 80 shorter), and on 40 held-out training rows:

    python benchmarks/passkey_probe.py --seq 256 --batch 16 --steps 1000 --heads 8

`--drills N` trains on drills instead (`retrieval_dataset(max_filler=N, ramp=True)`, read
in order: the filler grows from 0 to N over the first 3/4 of the run) and also reports
exact match on 40 held-out drills of 0 to N filler tokens. `--plot DIR` draws accuracy
against step.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from eqx_longctx.data import ByteTokenizer
from eqx_longctx.evals import make_sample, min_length, retrieval_dataset
from eqx_longctx.train import loss_fn, make_optimizer
from models.llama import Llama, LlamaConfig

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--seq", type=int, default=256, help="tokens per training row")
    p.add_argument("--batch", type=int, default=16, help="rows per step")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=100, help="steps between evals")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--hidden", type=int, default=344)
    p.add_argument("--theta", type=float, default=10000.0, help="RoPE base")
    p.add_argument("--tasks", default="passkey", help="retrieval tasks trained on")
    p.add_argument(
        "--drills",
        type=int,
        default=None,
        metavar="N",
        help="train on drills whose filler ramps from 0 to N tokens",
    )
    p.add_argument("--seed", type=int, default=0, help="the model's and the data's seed")
    p.add_argument("--save", default=None, metavar="FILE", help="save the weights here")
    p.add_argument("--plot", default=None, metavar="DIR", help="write passkey_probe.png here")
    a = p.parse_args()

    tok = ByteTokenizer()
    config = LlamaConfig(
        vocab_size=tok.vocab_size, dim=a.dim, n_layers=a.layers, n_heads=a.heads,
        n_kv_heads=a.heads, hidden_dim=a.hidden, rope_theta=a.theta, max_seq_len=a.seq,
    )  # fmt: skip
    params, static = eqx.partition(Llama(config, key=jax.random.key(a.seed)), eqx.is_array)
    rows = a.batch * a.steps
    train = retrieval_dataset(a.tasks.split(","), tok, a.seq, rows, seed=1 + a.seed,
                              loss="answers", max_filler=a.drills,
                              ramp=a.drills is not None)  # fmt: skip
    read = (
        (lambda s: train.rows(np.arange(s * a.batch, (s + 1) * a.batch)))
        if a.drills is not None
        else (lambda s: train.batch(s, a.batch))
    )  # a ramp is read in order
    held = retrieval_dataset(["passkey"], tok, a.seq, 40, seed=99, loss="answers").rows(
        np.arange(40)
    )
    drills = retrieval_dataset(["passkey"], tok, a.seq, 40, seed=98, loss="answers",
                               max_filler=a.drills or 0).rows(np.arange(40))  # fmt: skip
    optimizer = make_optimizer(a.lr, min(20, a.steps // 10), a.steps)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(lambda q: loss_fn(eqx.combine(q, static), batch)[0])(
            params
        )
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    rng = np.random.default_rng(7)
    shortest = min_length("passkey", tok, start=[tok.bos_id])
    lengths = [max(shortest, a.seq - 1 - (0 if i % 2 else int(rng.integers(0, 80))))
               for i in range(8)]  # fmt: skip
    samples = [
        make_sample("passkey", tok, length=n, depth=d, rng=rng, start=[tok.bos_id])
        for d in DEPTHS for n in lengths
    ]  # fmt: skip
    width = max(len(s.prompt_ids) + len(s.answer_ids) for s in samples)
    tokens = np.full((len(samples), width), tok.pad_id, np.int32)
    for i, s in enumerate(samples):
        ids = [*s.prompt_ids, *s.answer_ids]
        tokens[i, : len(ids)] = ids
    answer = len(samples[0].answer_ids)
    at = np.array([len(s.prompt_ids) for s in samples])[:, None] - 1 + np.arange(answer)

    @jax.jit
    def exact(params):
        model = eqx.combine(params, static)
        logits = model(tokens, jnp.broadcast_to(jnp.arange(width), tokens.shape))
        guess = jnp.argmax(jnp.take_along_axis(logits, jnp.asarray(at)[..., None], 1), -1)
        prompts = jnp.all(guess == np.take_along_axis(tokens, at + 1, 1), -1)
        logits = model(held.tokens, held.positions, held.segment_ids)
        ok = (jnp.argmax(logits, -1) == held.targets) | (held.loss_mask == 0)
        logits = model(drills.tokens, drills.positions, drills.segment_ids)
        drilled = (jnp.argmax(logits, -1) == drills.targets) | (drills.loss_mask == 0)
        return prompts, jnp.all(ok, -1).mean(), jnp.all(drilled, -1).mean()

    history = []
    start = time.perf_counter()
    for s in range(a.steps):
        params, state, loss = step(params, state, read(s))
        if (s + 1) % a.every == 0 or s + 1 == a.steps:
            prompts, rows, drilled = exact(params)
            by_depth = np.asarray(prompts).reshape(len(DEPTHS), -1).mean(1)
            history.append((s + 1, by_depth, float(rows)))
            print(f"step {s + 1}  {time.perf_counter() - start:.0f} s  loss {float(loss):.3f}  "
                  f"prompts {by_depth.mean():.0%} (by depth "
                  f"{' '.join(f'{x:.0%}' for x in by_depth)})  held-out rows {float(rows):.0%}"
                  + (f"  held-out drill rows {float(drilled):.0%}" if a.drills else ""),
                  flush=True)  # fmt: skip
    if a.save:
        eqx.tree_serialise_leaves(a.save, params)
    if a.plot:
        _plot(history, a.plot)


def _plot(history, directory) -> None:
    import _plots

    fig, ax = _plots.plt.subplots(figsize=(7, 4))
    steps = [h[0] for h in history]
    for i, depth in enumerate(DEPTHS):
        ax.plot(steps, [h[1][i] for h in history], marker="o", label=f"depth {depth:g}")
    ax.plot(steps, [h[2] for h in history], "k--", label="held-out rows")
    ax.set(xlabel="step", ylabel="exact match", ylim=(-0.02, 1.02),
           title="pass key retrieval while training (one device)")  # fmt: skip
    ax.legend(fontsize=8)
    _plots._save(fig, directory, "passkey_probe")


if __name__ == "__main__":
    main()
