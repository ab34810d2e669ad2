"""The planner's step time is the whole step's: every layer's matmuls and attention, each
layer stack at its own window; its model FLOPs and MFU; `--chip`'s figures reach the plan.

The seed's run is counted by hand here, from the Llama 3.1 8B config's numbers and no
planner code: 32 layers, dim 4096, 32 query and 8 key/value heads of 128, SwiGLU 14336,
vocabulary 128256, one row of T = 14680064 tokens on 64 chips.

- Active parameters N (every weight but the embedding): 32 x (4096 x 128 x (32 + 8 + 8 +
  32) + 3 x 4096 x 14336 + 2 x 4096) + 4096 + 4096 x 128256 = 7.50e9.
- Model FLOPs: 6 N T = 6.61e17 for the matmuls, plus causal attention, 4 x 128 FLOPs per
  (query, key) pair and head forward (q.k and p.v), 3 x that forward and backward, over
  T(T + 1)/2 pairs, 32 heads and 32 layers = 1.69e20; in all 1.70e20.
- The step the planner chooses under 95 GiB (ring, `remat="offload"`) runs each layer's
  forward again: 2 N T and one attention forward more, 2.26e20 FLOPs, 3.54e18 per chip:
  7.7e3 s at v5p's 459 TFLOP/s (the planner: 8.7e3 s, its attention backward recomputing
  the scores and the diagonal blocks computed whole).
"""

import json

import pytest
from helpers import plan_json

import eqx_longctx as el
from eqx_longctx.plan import CHIPS, main, plan_train_step
from eqx_longctx.run import placement_from_flags

T, CHIPS_USED, V5P = 14680064, 64, 459e12
L, DIM, HEADS, KV, HD, HIDDEN, VOCAB = 32, 4096, 32, 8, 128, 14336, 128256
N = L * (DIM * HD * (HEADS + 2 * KV + HEADS) + 3 * DIM * HIDDEN + 2 * DIM) + DIM + DIM * VOCAB
ATTENTION = 3 * 4 * HD * HEADS * L * T * (T + 1) // 2
MODEL_FLOPS = 6 * N * T + ATTENTION
OFFLOAD_FLOPS = MODEL_FLOPS + 2 * N * T + ATTENTION // 3  # each forward run again


def test_the_seeds_step_time_is_a_hand_count_of_its_flops():
    argv = [
        "--model", "llama", "--preset", "llama3.1-8b", "--seq", str(T), "--batch", "1",
        "--mesh", f"context={CHIPS_USED}", "--fsdp-axes", "context", "--train", "--override",
        "compute_dtype=bfloat16", "--chip", "v5p", "--json",
    ]  # fmt: skip
    record = plan_json(argv)  # its own process: 64 devices, more than this one's 8
    assert (record["strategy"], record["remat"], record["chip"]) == ("ring", "offload", "v5p")
    assert record["memory_budget_bytes"] == 95 * 2**30  # the chip's HBM, no budget flag
    assert MODEL_FLOPS == pytest.approx(1.70e20, rel=0.01)
    assert record["model_flops"] == pytest.approx(MODEL_FLOPS, rel=0.01)
    hand_s = OFFLOAD_FLOPS / CHIPS_USED / V5P  # 7.7e3 s
    ratio = record["predicted_time_s"] / hand_s
    assert 0.5 < ratio < 2, (record["predicted_time_s"], hand_s)
    assert record["predicted_flops_per_device"] == pytest.approx(OFFLOAD_FLOPS / 64, rel=0.25)
    mfu = MODEL_FLOPS / (record["predicted_time_s"] * CHIPS_USED * V5P)
    assert record["predicted_mfu"] == pytest.approx(mfu, rel=0.01)
    assert 0.5 < record["predicted_mfu"] < 0.75  # recomputation: at most 3/4 of model FLOPs


def _spec(mesh: str = "context=8", strategy: str = "ring") -> el.ShardingSpec:
    spec = placement_from_flags(8, mesh, strategy).spec  # the trainer's
    assert spec is not None
    return spec


def _row(remat: str = "full", seq: int = 8192, **fields):
    config = el.model_family("llama").config.from_preset("tiny", max_seq_len=seq, **fields)
    plan = plan_train_step("llama", config, _spec(), batch=1, seq=seq, remats=(remat,))
    return plan, plan.row("ring", remat)


def test_every_layer_is_counted_each_stack_at_its_window():
    one_plan, one = _row(n_layers=1)
    plan, four = _row()  # the tiny preset's 4 layers
    assert four.attention_s == pytest.approx(4 * one.attention_s)
    # Matmuls grow with the layers' parameters too (the output head's stay once).
    assert four.time_s - one.time_s > 3 * one.attention_s
    assert plan.model_flops > 3 * one_plan.model_flops
    # A model of 2 sliding and 2 full layers: each stack priced at its own window.
    _, slide = _row(n_layers=1, sliding_window=512)
    kinds = ("sliding_attention",) * 2 + ("full_attention",) * 2
    mixed_plan, mixed = _row(sliding_window=512, layer_types=kinds)
    assert slide.attention_s < one.attention_s  # 512 of 8192 keys (the ring's hops dominate)
    assert mixed.attention_s == pytest.approx(2 * slide.attention_s + 2 * one.attention_s)
    per_pair = 3 * 4 * 32 * 8  # forward and backward, head_dim 32, 8 heads
    full, slid = 8192 * 8193 // 2, 512 * 513 // 2 + (8192 - 512) * 512  # causal pairs
    matmuls = plan.model_flops - 4 * full * per_pair
    assert mixed_plan.model_flops == pytest.approx(matmuls + 2 * (full + slid) * per_pair)


def test_chip_sets_the_rates_and_the_budget():
    config = el.model_family("llama").config.from_preset("tiny", max_seq_len=8192)
    plans = {
        chip: plan_train_step("llama", config, _spec(), batch=1, seq=8192, chip=chip)
        for chip in ("v5e", "v5p", "tpu7x")
    }
    for name, plan in plans.items():
        chip = CHIPS[name]
        per_device = chip.devices_per_chip  # TPU7x: two devices (chiplets) per chip
        assert plan.problem["flops_per_s"] == chip.flops_per_s / per_device
        assert plan.problem["memory_budget_bytes"] == chip.hbm_bytes // per_device
        assert plan.problem["bytes_per_s"] == chip.link_bytes_per_s
    assert plans["v5p"].problem["memory_budget_bytes"] == 95 * 2**30
    assert plans["tpu7x"].problem["flops_per_s"] == 2307e12 / 2
    mfus = {name: plan.row("ring", "full").mfu for name, plan in plans.items()}
    assert len(set(mfus.values())) == 3, mfus  # faster chips: communication weighs more
    # Explicit figures win over the chip's.
    plan = plan_train_step("llama", config, _spec(), batch=1, seq=8192, chip="v5p",
                           flops_per_s=1e12, memory_budget_bytes=2**30)  # fmt: skip
    assert plan.problem["flops_per_s"] == 1e12 and plan.problem["memory_budget_bytes"] == 2**30
    # A ring over more GPUs than one NVLink node crosses InfiniBand.
    assert CHIPS["h100"].hop_bytes_per_s(8) == 450e9 and CHIPS["h100"].hop_bytes_per_s(64) == 50e9


def test_cli_chip_reaches_the_table_and_the_json(capsys):
    argv = ["--model", "llama", "--preset", "tiny", "--seq", "8192", "--batch", "2", "--mesh",
            "fsdp=2,context=4", "--train", "--remat", "full", "--strategy", "ring"]  # fmt: skip
    main([*argv, "--chip", "v6e"])
    text = capsys.readouterr().out
    assert "budget 32 GiB" in text and "918 TFLOP/s" in text and "(v6e)" in text
    assert "MFU" in text and "model FLOPs per step" in text
    main([*argv, "--chip", "v6e", "--memory-budget-gib", "2", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert record["memory_budget_bytes"] == 2 * 2**30 and record["chip"] == "v6e"
    assert 0 < record["predicted_mfu"] < 1 and record["rows"][0]["mfu"] == record["predicted_mfu"]


def test_an_unknown_chip_is_one_line_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", "llama", "--preset", "tiny", "--train", "--chip", "v4"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--chip must be one of v5p, v5e, v6e, tpu7x, h100, h200; got 'v4'" in err
    assert "Traceback" not in err
    config = el.model_family("llama").config.from_preset("tiny", max_seq_len=8192)
    with pytest.raises(ValueError, match=r"plan_train_step: chip must be one of v5p, v5e"):
        plan_train_step("llama", config, _spec(), batch=1, seq=8192, chip="a100")
