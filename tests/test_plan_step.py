"""The whole-step memory planner against XLA, and its errors.

Every entry of `CASES` is a training run as the trainer sets it up (`TrainConfig` ->
`build_model_config` and `Placement`); it is planned and then compiled (never run) on the 8
fake CPU devices: the trainer's own step under the trainer's placement, for abstract
sharded arrays. The predicted bytes per device must be within `TOLERANCE` of XLA's memory
analysis (arguments + outputs + temporaries - donated buffers).
"""

import json
import math

import pytest
from helpers import plan_json

import eqx_longctx as el
from eqx_longctx.plan import compiled_bytes, main, plan_train_step
from eqx_longctx.plan._compile import compile_train_step, trainer_run
from eqx_longctx.run import placement_from_flags
from eqx_longctx.train import TrainConfig

TOLERANCE = 0.2

# id: (family, mesh, fsdp axes, strategy, remat, seq, batch, config overrides)
# Pairwise, not the product of mesh and remat: fsdp meets full and dots (its none is
# llama-context-none's), DeepSeek's expert axis meets none, dots (expert=4) and full
# (expert4-capacity); llama-fsdp-none and deepseek-expert-full (~40 s of one core) ran
# nothing those rows do not.
CASES = {
    "llama-context-none": ("llama", {"context": 8}, (), "ring", "none", 8192, 1, {}),
    "llama-context-full": ("llama", {"context": 8}, (), "ring", "full", 16384, 1, {}),
    "llama-data-dots-vocab": (
        "llama", {"data": 2, "context": 4}, (), "ring", "dots", 8192, 2, {"vocab_size": 8192},
    ),
    "llama-fsdp-full": ("llama", {"fsdp": 2, "context": 4}, ("fsdp",), "ring", "full", 8192, 2, {}),
    "llama-fsdp-over-context-dots": (
        "llama", {"fsdp": 2, "context": 4}, ("fsdp", "context"), "ring", "dots", 8192, 2, {},
    ),
    "llama-weights-on-context-full": (
        "llama", {"context": 8}, ("context",), "ring", "full", 8192, 1, {},
    ),
    "llama-tensor-full": (
        "llama", {"tensor": 2, "context": 4}, (), "ring", "full", 8192, 1, {"vocab_size": 512},
    ),
    "llama-usp-none": ("llama", {"ulysses": 2, "context": 4}, (), "usp", "none", 8192, 1, {}),
    "llama-all_gather-none": ("llama", {"context": 8}, (), "all_gather", "none", 8192, 1, {}),
    "deepseek-context-full": ("deepseek", {"context": 8}, (), "ring", "full", 8192, 1, {}),
    "deepseek-expert-none": (
        "deepseek", {"expert": 2, "context": 4}, (), "ring", "none", 8192, 2, {},
    ),
    # Hold-out cases for the expert-parallel local layer (each device's share of the
    # experts): checked, never tuned on.
    "deepseek-expert4-capacity-full": (
        "deepseek", {"expert": 4, "context": 2}, (), "ring", "full", 8192, 4,
        {"n_routed_experts": 16, "capacity_factor": 1.25, "grouped_matmul": "scan"},
    ),
    "deepseek-expert4-dropless-dots": (
        "deepseek", {"expert": 4, "context": 2}, (), "ring", "dots", 8192, 4, {},
    ),
    "deepseek-tensor-none": (
        "deepseek", {"tensor": 2, "context": 4}, (), "ring", "none", 8192, 1, {},
    ),
}  # fmt: skip


def _settings(**kw) -> TrainConfig:
    """A run's settings as the trainer's CLI would give them (8 devices, the tiny preset)."""
    base = dict(preset="tiny", seq_len=8192, batch_size=1, devices=8, mesh="context=8",
                run_dir="unused", progress=False)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _spec(mesh: str, strategy: str) -> el.ShardingSpec:
    spec = placement_from_flags(8, mesh, strategy).spec  # the trainer's
    assert spec is not None
    return spec


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_prediction_is_within_tolerance_of_compiled(case):
    family, mesh, fsdp, strategy, remat, seq, batch, overrides = CASES[case]
    run = trainer_run(
        _settings(
            model=family, model_overrides=overrides, seq_len=seq, batch_size=batch,
            mesh=",".join(f"{k}={v}" for k, v in mesh.items()),
            fsdp_axes=",".join(fsdp) or None, strategy=strategy, remat=remat,
        )
    )  # fmt: skip
    spec = run.placement.spec
    plan = plan_train_step(
        run.family, run.config, spec, batch=batch, seq=seq, remats=(remat,), strategies=(strategy,)
    )
    predicted = plan.row(strategy, remat)
    compiled = compiled_bytes(compile_train_step(run))
    ratio = predicted.device / compiled.device
    assert abs(ratio - 1) <= TOLERANCE, (case, ratio, predicted.breakdown(), compiled)


def test_grad_accum_is_planned_per_micro_batch():
    """`--grad-accum 4`: the prediction against the compiled accumulating step, and the
    activations of a micro-batch (a quarter of the whole batch's)."""
    run = trainer_run(_settings(mesh="data=2,context=4", seq_len=4096, batch_size=8,
                                grad_accum=4, remat="none"))  # fmt: skip
    spec = run.placement.spec
    kw = dict(batch=8, seq=4096, remats=("none",), strategies=("ring",))
    accumulated = plan_train_step(run.family, run.config, spec, grad_accum=4, **kw)
    whole = plan_train_step(run.family, run.config, spec, **kw)
    row = accumulated.row("ring", "none")
    assert row.activations * 4 == pytest.approx(whole.row("ring", "none").activations, rel=1e-3)
    compiled = compiled_bytes(compile_train_step(run))
    ratio = row.device / compiled.device
    assert abs(ratio - 1) <= TOLERANCE, (ratio, row.breakdown(), compiled)
    with pytest.raises(ValueError, match="batch=8 rows must split into grad_accum=3"):
        plan_train_step(run.family, run.config, spec, grad_accum=3, **kw)


@pytest.mark.parametrize("loss_chunk", [None, 0])
def test_the_loss_is_planned_in_chunks_or_whole(loss_chunk):
    """A 64K vocabulary split over a tensor axis, 2048 tokens per device: the whole logits
    (`--loss-chunk 0`: every device's tokens over its half of the vocabulary) dominate the
    step; the chunked loss holds 1024 of those tokens at a time. Both predictions against
    the compiled step."""
    run = trainer_run(
        _settings(mesh="tensor=2,context=4", remat="full", loss_chunk=loss_chunk,
                  model_overrides={"vocab_size": 65536})
    )  # fmt: skip
    spec = run.placement.spec
    kw = dict(batch=1, seq=8192, remats=("full",), strategies=("ring",), loss_chunk=loss_chunk)
    row = plan_train_step(run.family, run.config, spec, **kw).row("ring", "full")
    tokens, half = 8192 // 4, 65536 // 2
    if loss_chunk == 0:
        assert row.logits == int(2.5 * tokens * half * 4)
    else:
        chunk = (128 * 2**20) // (4 * half)
        assert chunk < tokens and row.logits == int(2.5 * chunk * half * 4)
    compiled = compiled_bytes(compile_train_step(run))
    ratio = row.device / compiled.device
    assert abs(ratio - 1) <= TOLERANCE, (ratio, row.breakdown(), compiled)


def test_offload_moves_the_layer_inputs_to_host_memory():
    config = el.model_family("llama").config.from_preset("tiny", max_seq_len=8192)
    plan = plan_train_step("llama", config, _spec("context=8", "ring"), batch=1, seq=8192)
    full, offload = plan.row("ring", "full"), plan.row("ring", "offload")
    layer_input = 8192 // 8 * config.dim * 4
    assert offload.host == config.n_layers * layer_input and full.host == 0
    assert full.device - offload.device == config.n_layers * layer_input


def test_stacks_of_one_kind_are_priced_by_the_local_stack_of_that_kind():
    # Mixed sliding / full layers run as a tuple of stacks ("layers[0]", "layers[1]"); the
    # local model the planner traces has one stack of that kind ("layers").
    from eqx_longctx.plan._activations import stack_activations

    family = el.model_family("llama")
    kinds = ("sliding_attention",) * 2 + ("full_attention",) * 2
    config = family.config.from_preset(
        "tiny", max_seq_len=1024, sliding_window=256, layer_types=kinds
    )
    stacks = stack_activations(family, config, batch=1, seq=1024)
    assert [(s.path, s.n_layers) for s in stacks] == [("layers[0]", 2), ("layers[1]", 2)]
    uniform = stack_activations(family, family.config.from_preset("tiny"), batch=1, seq=1024)
    assert [s.saved for s in stacks] == [uniform[0].saved] * 2


def test_budget_picks_the_fastest_row_that_fits():
    config = el.model_family("llama").config.from_preset("tiny", max_seq_len=16384)
    spec = _spec("context=8", "auto")
    free = plan_train_step("llama", config, spec, batch=1, seq=16384)
    assert free.chosen is not None and free.chosen.remat == "none"  # no budget: fastest
    none = min(r.device for r in free.rows if r.remat == "none")
    tight = plan_train_step("llama", config, spec, batch=1, seq=16384, memory_budget_bytes=none - 1)
    assert tight.chosen is not None and tight.chosen.remat != "none"
    assert tight.chosen.device < none
    assert "chosen" in tight.explain() and "layer bwd" in tight.explain()


def test_nothing_fits_the_budget_says_what_would():
    config = el.model_family("llama").config.from_preset("tiny", max_seq_len=8192)
    spec = _spec("context=8", "ring")
    plan = plan_train_step(
        el.model_family("llama"), config, spec, batch=1, seq=8192, memory_budget_bytes=2**20
    )
    assert plan.chosen is None
    assert "nothing fits 1 MiB per device; the least is ring with remat=" in plan.reason
    assert "which fits a budget of" in plan.reason and "more devices" in plan.reason
    with pytest.raises(ValueError, match="no prediction for strategy='ring', remat='fast'"):
        plan.row("ring", "fast")
    with pytest.raises(SystemExit):
        main(_argv("--memory-budget-gib", "0.001"))


def _argv(*extra):
    return [
        "--model", "llama", "--preset", "tiny", "--seq", "8192", "--batch", "2", "--mesh",
        "fsdp=2,context=4", "--train", *extra,
    ]  # fmt: skip


def test_cli_prints_the_breakdown_and_the_choice(capsys):
    main(_argv("--memory-budget-gib", "1"))
    text = capsys.readouterr().out
    for word in ("params", "grads", "opt state", "activations", "logits", "offload", "chosen"):
        assert word in text


def test_the_seeds_run_fits_64_v5p_chips():
    """docs/scaling.md's headline: Llama 3.1 8B at 14M tokens on 64 chips fits the v5p's
    95 GiB (ring, offload). Its 229K x 229K ring hops once stopped the planner (the kernels'
    block schedule overflowed SMEM), and RoPE's tables were counted once per layer."""
    argv = [
        "--model", "llama", "--preset", "llama3.1-8b", "--seq", "14680064", "--batch", "1",
        "--mesh", "context=64", "--fsdp-axes", "context", "--train", "--override",
        "compute_dtype=bfloat16", "--memory-budget-gib", "95", "--json",
    ]  # fmt: skip
    record = plan_json(argv)  # its own process: 64 devices, more than this one's 8
    assert (record["strategy"], record["remat"]) == ("ring", "offload"), record
    assert 90 * 2**30 < record["predicted_bytes_per_device"] <= 95 * 2**30, record


def test_cli_json_has_predicted_and_compiled_bytes(capsys):
    main(_argv("--remat", "full", "--strategy", "ring", "--json"))
    record = json.loads(capsys.readouterr().out)
    assert record["predicted_bytes_per_device"] > 0
    assert record["compiled_bytes_per_device"] is None
    assert set(record["breakdown"]) >= {"params", "grads", "opt_state", "activations", "logits"}
    main(_argv("--remat", "full", "--strategy", "ring", "--json", "--compile"))
    record = json.loads(capsys.readouterr().out)
    ratio = record["predicted_bytes_per_device"] / record["compiled_bytes_per_device"]
    assert abs(ratio - 1) <= TOLERANCE


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--model", "gpt", "--preset", "tiny", "--train"], "unknown model family 'gpt'"),
        (
            ["--model", "llama", "--preset", "huge", "--train"],
            r"--preset must be one of --model llama's presets \[.*\]; got --preset 'huge'",
        ),
        (["--model", "llama", "--preset", "tiny"], "--model plans a train step: pass --train"),
        (["--model", "llama", "--train"], "needs --preset"),
        (
            ["--model", "llama", "--preset", "tiny", "--train", "--override", "layers=2"],
            r"--override must name LlamaConfig fields; got unknown \['layers'\]",
        ),
        (
            ["--model", "llama", "--preset", "tiny", "--train", "--override", "n_layers"],
            "--override takes FIELD=VALUE",
        ),
        (
            ["--model", "llama", "--preset", "tiny", "--train", "--override", "n_layers=two"],
            r"override n_layers='two' must parse as int",
        ),
        (
            ["--model", "llama", "--preset", "tiny", "--train", "--fsdp-axes", "fsdp"],
            "--fsdp-axes names mesh axes joined by commas, each one of --mesh",
        ),
        (
            [
                "--model",
                "llama",
                "--preset",
                "tiny",
                "--train",
                "--batch",
                "1",
                "--mesh",
                "data=2,context=4",
            ],
            "batch must be divisible by 2",
        ),  # fmt: skip
        (
            ["--model", "llama", "--preset", "tiny", "--train", "--mesh", "tensor=8,context=1"],
            "q_heads and kv_heads must be divisible by 8; got q_heads=8, kv_heads=4",
        ),
        (
            [
                "--model",
                "llama",
                "--preset",
                "tiny",
                "--train",
                "--mesh",
                "tensor=8,context=1",
                "--override",
                "n_kv_heads=8",
                "--override",
                "hidden_dim=340",
            ],
            "does not split over mesh axes tensor=8",
        ),  # fmt: skip
    ],
)
def test_cli_errors_name_the_rule_and_the_fix(argv, match, capsys):
    base = ["--mesh", "context=8", "--seq", "8192"]
    with pytest.raises(SystemExit) as e:
        main([*base, *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert pytest.importorskip("re").search(match, err), err
    assert "Traceback" not in err


def test_runs_are_set_up_by_the_trainers_code():
    with pytest.raises(ValueError, match="--preset must be one of --model deepseek's presets"):
        trainer_run(_settings(model="deepseek", preset="tiny2"))
    with pytest.raises(ValueError, match=r"--override must name LlamaConfig fields"):
        trainer_run(_settings(model_overrides={"n_layers": "2", "layers": "2"}))
    overrides = {"n_layers": "2", "compute_dtype": "bfloat16"}  # CLI text, as --override
    run = trainer_run(_settings(model_overrides=overrides, seq_len=4096, mesh="fsdp=2,context=4"))
    assert run.config.n_layers == 2 and run.config.compute_dtype == "bfloat16"
    assert run.config.max_seq_len == 4096 and run.config.vocab_size == 259  # the preset's
    assert run.placement.spec == placement_from_flags(8, "fsdp=2,context=4", "ring").spec
    assert run.placement.spec.fsdp_axis == ("fsdp",)
    with pytest.raises(ValueError, match="got --fsdp-axes 'expert'"):
        _settings(fsdp_axes="expert")
    deepseek = el.model_family("deepseek").config.from_preset("tiny", max_seq_len=8192)
    with pytest.raises(ValueError, match=r"tensor_axis 'tensor' has 8 devices and shards the "
                       r"heads.*divisible by 8; got q_heads=4, kv_heads=4"):  # fmt: skip
        spec = _spec("tensor=8,context=1", "ring")
        plan_train_step("deepseek", deepseek, spec, batch=1, seq=8192)
    with pytest.raises(ValueError, match="strategy 'ulysses' cannot run these shapes"):
        spec = _spec("context=8", "ulysses")  # 4 heads over 8 devices
        plan_train_step("deepseek", deepseek, spec, batch=1, seq=8192, strategies=("ulysses",))
    config = el.model_family("llama").config.from_preset("tiny", max_seq_len=8192)
    with pytest.raises(ValueError, match="seq=1000 must be divisible by 16"):
        plan_train_step("llama", config, _spec("context=8", "ring"), batch=1, seq=1000)
    with pytest.raises(TypeError, match="plan_train_step needs family=a ModelFamily or the name"):
        plan_train_step(config, config, _spec("context=8", "ring"), batch=1, seq=8192)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (
            dict(strategies=("rnig",)),
            ValueError,
            r"plan_train_step: unknown strategy 'rnig' in strategies=\('rnig',\); choose from "
            r"\('all_gather', 'ulysses', 'ring', 'usp'\)\. Or leave strategies=None",
        ),
        (dict(strategies=("auto",)), ValueError, r"unknown strategy 'auto'"),
        (dict(strategies=()), ValueError, r"strategies=\(\) names no strategy; pass at least one"),
        (dict(remats=[]), ValueError, r"remats=\(\) names no remat policy"),
        (
            dict(remats=("full", "fast")),
            ValueError,
            r"plan_train_step: unknown remat policy 'fast' in remats=\('full', 'fast'\); "
            r"choose from \('none', 'dots', 'offload', 'full'\)",
        ),
        (
            dict(strategies="ring"),
            TypeError,
            r"plan_train_step: strategies must be a tuple of strategy names; got 'ring' \(str\)\. "
            r"Pass \('ring',\)",
        ),
        (
            dict(spec="mesh"),
            TypeError,
            r"plan_train_step needs spec=a ShardingSpec; got Mesh\(.*\) \(Mesh\)\. Build one with "
            r"ShardingSpec\(mesh\) \(the mesh goes inside the spec\)",
        ),
        (
            dict(memory_budget_bytes=-1),
            ValueError,
            r"plan_train_step: memory_budget_bytes must be > 0; got -1\.0\. Pass the bytes each "
            r"device may use",
        ),
        (dict(memory_budget_bytes=0), ValueError, r"memory_budget_bytes must be > 0; got 0\.0"),
        (dict(memory_budget_bytes=math.inf), ValueError, r"memory_budget_bytes must be finite"),
        (dict(memory_budget_bytes="16G"), TypeError, r"memory_budget_bytes must be a real number"),
        (dict(flops_per_s=-1.0), ValueError, r"plan_train_step: flops_per_s must be > 0"),
    ],
)
def test_step_argument_errors_name_the_rule(kwargs, error, match):
    """Bad arguments raise before any planning, with the rule choose_strategy applies."""
    config = el.model_family("llama").config.from_preset("tiny", max_seq_len=8192)
    spec = _spec("context=8", "ring")
    if kwargs.get("spec") == "mesh":
        kwargs = {**kwargs, "spec": spec.mesh}
    args = {"spec": spec, **kwargs}
    with pytest.raises(error, match=match):
        plan_train_step("llama", config, args.pop("spec"), batch=1, seq=8192, **args)
