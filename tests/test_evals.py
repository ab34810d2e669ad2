"""The eval runner and its command line: a very small run of the `passkey` recipe ends
with its eval and files, an untrained model finds no key, `--check-strategies` passes on
the run and fails on a planted ring or sinks bug, `--override` stretches a model, and bad
input is one line with exit status 2.

A trained model that retrieves: tests/test_evals_retrieval.py (the recipe's first stage
trained to its end, about 8 minutes: the full tier)."""

import dataclasses
import json
import pathlib
import sys

import jax
import numpy as np
import pytest

from eqx_longctx.data import ByteTokenizer
from eqx_longctx.evals import (
    EvalModel,
    check_strategies,
    evaluate_and_write,
    position_loss,
    run_samples,
    score,
    task_samples,
)
from eqx_longctx.evals import eval_main as main
from eqx_longctx.run import Placement

SEQ = 256
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> pathlib.Path:
    """A very small run of the passkey recipe (its eval at the end included): a run
    directory with a checkpoint, for the command line's tests."""
    from eqx_longctx.train._cli import main as train_main

    run = tmp_path_factory.mktemp("passkey") / "run"
    flags = [
        "--recipe", "passkey", "--no-stages", "--seq-len", str(SEQ), "--steps", "20",
        "--synthetic-share", "0.75",
        "--max-bytes", "200000", "--devices", "4", "--mesh", "data=2,context=2",
        "--eval-every", "1000", "--checkpoint-every", "1000", "--run-dir", str(run),
        "--no-progress",
    ]  # fmt: skip
    assert train_main(flags) == 0
    return run


def test_recipe_run_ends_with_its_eval_and_the_untrained_model_finds_nothing(trained):
    result = json.loads((trained / "eval" / "results.json").read_text())
    table = result["tasks"]["passkey"]
    assert table["lengths"] == [SEQ - 1] and table["depths"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert table["samples"] == [[10]] * 5
    assert 0.0 <= table["overall"] <= 1.0
    assert (trained / "eval" / "heatmap-passkey.png").stat().st_size > 1000
    lines = (trained / "eval" / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 50
    for line in lines:
        record = json.loads(line)
        assert set(record) == {"task", "length", "depth", "prompt", "answer", "output", "correct"}
        assert record["prompt"].count(record["answer"]) == 1
        assert record["correct"] == score(record["output"], record["answer"])

    from models import LLAMA

    config = dataclasses.replace(
        LLAMA.presets["tiny"], vocab_size=259, n_layers=2, dim=128, hidden_dim=344
    )
    fresh = LLAMA.model(config, key=jax.random.key(0))
    em = EvalModel(fresh, TOK, (TOK.bos_id,), frozenset({TOK.eos_id}))
    samples = task_samples(em, ["passkey"], [SEQ], [0.0, 0.5, 1.0], 4, seed=1)
    records = run_samples(em, samples)
    assert sum(r["correct"] for r in records) == 0


def _eval(trained, tmp_path, *extra) -> int:
    return main(
        ["--run-dir", str(trained), "--task", "passkey", "--lengths", str(SEQ), "--depths",
         "0,1", "--samples", "2", "--no-progress", "--out", str(tmp_path / "out"), *extra]
    )  # fmt: skip


def test_check_strategies_passes_on_the_trained_model(trained, tmp_path, capsys):
    code = _eval(trained, tmp_path, "--devices", "4", "--check-strategies")
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    runs = result["check_strategies"]["runs"]
    ran = {(r["strategy"], r["load_balance"]) for r in runs if r["status"] == "identical"}
    assert ("one device", "-") in ran
    assert {("ring", "zigzag"), ("all_gather", "striped"), ("ulysses", "none")} <= ran, runs
    for name in ("heatmap-passkey.png", "samples.jsonl", "results.json"):
        assert (tmp_path / "out" / name).stat().st_size > 0


def _check_with_ring(monkeypatch, broken, em, samples, baseline, load):
    """`check_strategies` with the ring replaced by `broken` (compiled programs dropped
    before and after); **returns** `(result, {(strategy, layout): status})`."""
    monkeypatch.setattr(sys.modules["eqx_longctx.attention"], "ring_latent_attention", broken)
    jax.clear_caches()
    try:
        result = check_strategies(em, samples, baseline, load)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    return result, {(r["strategy"], r["load_balance"]): r["status"] for r in result["runs"]}


def _random_llama(spec):
    from models import LLAMA

    config = dataclasses.replace(
        LLAMA.presets["tiny"], vocab_size=259, n_layers=2, dim=128, hidden_dim=344
    )
    return LLAMA.model(config, key=jax.random.key(7), spec=spec)


def test_check_strategies_catches_a_ring_cut_short(monkeypatch):
    attention = sys.modules["eqx_longctx.attention"]

    def load(strategy="ring", load_balance="zigzag", devices=4, mesh="context"):
        if strategy not in ("ring", "all_gather") or load_balance != "zigzag":
            raise ValueError("not in this test")
        p = Placement(devices, None if devices == 1 else {"context": 4}, strategy, load_balance)
        # Untrained: every key moves its outputs, so lost hops show in the greedy tokens.
        return EvalModel(_random_llama(p.spec), TOK, (TOK.bos_id,), frozenset({TOK.eos_id}))

    em = load()
    samples = task_samples(em, ["passkey"], [SEQ], [0.0, 0.5], 2, seed=5)
    baseline = run_samples(em, samples)
    ring = attention.ring_latent_attention

    def local_shard_only(*args, **kwargs):
        return ring(*args, **{**kwargs, "hops": 1})  # no hop: each device sees its own keys

    result, status = _check_with_ring(monkeypatch, local_shard_only, em, samples, baseline, load)
    assert not result["identical"], result
    assert status[("ring", "zigzag")] == "differs", status
    assert status[("all_gather", "zigzag")] == status[("one device", "-")] == "identical"


def _sinks_model(spec):
    from models import GPT_OSS

    config = dataclasses.replace(
        GPT_OSS.presets["tiny"], n_layers=2, n_experts=2, top_k=1, max_seq_len=512,
        layer_types=("sliding_attention", "full_attention"),
    )  # fmt: skip
    model = GPT_OSS.model(config, key=jax.random.key(3), spec=spec)

    # Sinks as large as the keys' log-sum-exp, so that ignoring them changes the outputs.
    def bump(path, x):
        return x + 6.0 if "sinks" in jax.tree_util.keystr(path) else x

    return jax.tree_util.tree_map_with_path(bump, model)


def test_check_strategies_catches_sinks_ignored_under_one_strategy(monkeypatch):
    attention = sys.modules["eqx_longctx.attention"]

    def load(strategy="ring", load_balance="zigzag", devices=4, mesh="context"):
        if strategy != "ring" or load_balance != "zigzag":
            raise ValueError("not in this test")
        p = Placement(devices, None if devices == 1 else {"context": 4}, strategy, load_balance)
        return EvalModel(_sinks_model(p.spec), TOK, (TOK.bos_id,), frozenset({TOK.eos_id}))

    em = load()
    samples = task_samples(em, ["passkey"], [160], [0.5], 2, seed=0)
    baseline = run_samples(em, samples)
    assert check_strategies(em, samples, baseline, load)["identical"]

    ring = attention.ring_latent_attention

    def sinks_ignored(*args, **kwargs):
        out, lse = ring(*args, **kwargs)
        return out, lse + 1e4  # sigmoid(lse - sink) = 1: the sinks do nothing

    result, status = _check_with_ring(monkeypatch, sinks_ignored, em, samples, baseline, load)
    assert not result["identical"], result
    assert status[("ring", "zigzag")] == "differs" and status[("one device", "-")] == "identical"


def test_position_loss_is_the_bucketed_token_loss(trained):
    """Under the run's spec (4 devices, zig-zag), against each token's loss from the
    whole float32 logits on one device, bucketed by hand."""
    from eqx_longctx.evals._cli import build_parser
    from eqx_longctx.evals._load import load_eval_model

    args = build_parser().parse_args(["--run-dir", str(trained), "--devices", "4"])
    em = load_eval_model(args)
    docs = ["".join(f"line {i % 7}: the same words again and again\n" for i in range(40))] * 3
    curves = position_loss(em, docs, [SEQ], rows=2, buckets=4)[SEQ]
    assert curves["tokens"] == [128, 128, 128, 126] and curves["rows"] == 2

    one = load_eval_model(args, devices=1, mesh=None)
    rows = np.array([[TOK.bos_id, *TOK.encode(d)[: SEQ - 1]] for d in docs[:2]], np.int32)
    logits = np.asarray(one.model(rows), np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp[:, :-1], rows[:, 1:, None], -1)[..., 0]
    want = [nll[:, k * 64 : (k + 1) * 64].mean() for k in range(4)]
    np.testing.assert_allclose(curves["loss"], want, rtol=1e-5)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--task", "passkey,haystack"], "unknown ['haystack']"),
        (["--depths", "0,1.5"], "fractions in [0, 1]"),
        (["--samples", "0"], "--samples must be a whole number >= 1"),
        (["--lengths", "1"], "token counts >= 2"),
    ],
)
def test_bad_flags_are_one_line(flags, words, capsys, tmp_path):
    assert main([*flags, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert main(["--out", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out must be a directory" in err


def test_length_above_max_seq_len_is_refused(trained, tmp_path, capsys):
    code = main(["--run-dir", str(trained), "--lengths", "4096", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "max_seq_len=2048" in err, err


def test_writes_files_through_the_library(tmp_path):
    from models import LLAMA

    config = dataclasses.replace(LLAMA.presets["tiny"], vocab_size=259, n_layers=1, dim=64,
                                 n_heads=4, n_kv_heads=2, hidden_dim=128)  # fmt: skip
    em = EvalModel(LLAMA.model(config, key=jax.random.key(0)), TOK, (TOK.bos_id,),
                   frozenset({TOK.eos_id}))  # fmt: skip
    result = evaluate_and_write(
        em, tmp_path, tasks=["niah_single", "mqar"], lengths=[400, 600], depths=[0.0, 1.0],
        samples=1, seed=0, progress=False, say=lambda _: None,
    )  # fmt: skip
    for task in ("niah_single", "mqar"):
        assert result["tasks"][task]["lengths"] == [400, 600]
        assert (tmp_path / f"heatmap-{task}.png").stat().st_size > 1000
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * 2


def test_overrides_stretch_a_model_and_keep_its_weights():
    from eqx_longctx.evals import with_overrides
    from eqx_longctx.nn import LinearRopeScaling, YarnRopeScaling
    from models import LLAMA

    config = dataclasses.replace(LLAMA.presets["tiny"], vocab_size=259, n_layers=1, dim=64,
                                 n_heads=4, n_kv_heads=2, hidden_dim=128)  # fmt: skip
    model = LLAMA.model(config, key=jax.random.key(0))
    yarn = '{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 2048}'
    long = with_overrides(model, [("max_seq_len", "8192"), ("rope_scaling", yarn)])
    assert long.config.max_seq_len == 8192
    assert long.config.rope_scaling == YarnRopeScaling(4.0, 2048)
    assert all(a is b for a, b in zip(jax.tree.leaves(long), jax.tree.leaves(model), strict=True))
    tokens = np.arange(4096, dtype=np.int32)[None] % 256
    assert long(tokens).shape == (1, 4096, 259)
    short = model(tokens[:, :512])
    # Scaling changes the rotation, so the logits too; max_seq_len alone changes nothing.
    assert np.abs(np.asarray(long(tokens[:, :512]) - short)).max() > 1e-3
    same = with_overrides(model, [("max_seq_len", "8192")])
    np.testing.assert_array_equal(np.asarray(same(tokens[:, :512])), np.asarray(short))
    linear = with_overrides(model, [("rope_scaling", '{"rope_type": "linear", "factor": 2}')])
    assert linear.config.rope_scaling == LinearRopeScaling(2.0)
    with pytest.raises(ValueError, match="would change the model's weights"):
        with_overrides(model, [("n_layers", "2")])
    with pytest.raises(ValueError, match="rope_type one of"):
        with_overrides(model, [("rope_scaling", '{"rope_type": "ntk", "factor": 2}')])


@pytest.mark.parametrize("name", ["passkey", "passkey-hybrid", "passkey-gemma3"])
def test_recipes_set_their_flags_and_fit_their_mesh(name):
    """Each recipe's defaults reach the parsed flags (a flag given still wins), and its
    model, rows and mesh pass the trainer's placement check on the main job's 8 devices."""
    from eqx_longctx import model_family
    from eqx_longctx.run import placement_from_flags, preset_model_config
    from eqx_longctx.train._cli import parse_flags
    from eqx_longctx.train._recipes import RECIPES

    recipe = RECIPES[name]
    args = parse_flags(["--recipe", name, "--steps", "7"])
    assert args.steps == 7 and args.seq_len == recipe.flags["seq_len"] == 2048
    assert args.synthetic == recipe.flags["synthetic"] and args.model == recipe.flags.get(
        "model", "llama"
    )
    config = preset_model_config(
        args.model, args.preset, dict(args.override), vocab_size=259, seq_len=args.seq_len
    )
    placement = placement_from_flags(args.devices, args.mesh, args.strategy, args.load_balance)
    placement.check_run(args.batch_size, args.seq_len, config, family=model_family(args.model))
