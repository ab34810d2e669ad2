# Recipe: Llama 3.1 8B (the llama3.1-8b preset, byte vocabulary) on one sequence of 1M tokens.
#
#   RECIPE=examples/recipes/llama3.1-8b-1m.sh SLICE=v5p examples/cloud_tpu.sh create
#   RECIPE=examples/recipes/llama3.1-8b-1m.sh SLICE=v5p examples/cloud_tpu.sh setup
#   RECIPE=examples/recipes/llama3.1-8b-1m.sh SLICE=v5p examples/cloud_tpu.sh train
#   bash examples/recipes/llama3.1-8b-1m.sh       # print the command every worker runs
#
# Same entry point as the laptop main job: `python -m eqx_longctx.train`, one process per
# host; --devices is the slice's chip count.
#
# Mesh: context=64 with the weights, gradients and AdamW state split over it (--fsdp-axes
# context, ZeRO-3): every chip holds 16,384 of the 1,048,576 tokens and 1/64 of the 8B
# parameters' 128 GB of float32 state (417 MiB of weights, 834 MiB of moments per chip).
# Strategy: ring in a zig-zag layout. All-gather would gather every key and value (its layer
# backward needs 21.6-27.2 GiB against ring's 2.6-8.3 GiB); Ulysses is capped at the 8
# key-value heads, and Ulysses x ring (--mesh ulysses=8,context=8 --strategy usp) was planned
# too: the same predicted time and 0.2 GiB more per chip.
# Remat: the fastest policy that fits the chip. On v5p (95 GiB) `dots` (keep the
# projections' outputs, recompute the rest): 52.2 GiB, where `none` would need 173 GiB. On
# v6e (32 GiB) `dots` does not fit; `offload` (each layer's input kept in host memory,
# everything else recomputed) needs 9.94 GiB on the chip and 4 GiB of host memory, as fast
# as `full` (13.9 GiB) by the planner's count.
#
# The planner, for exactly this run (vocab_size=259: the CLI's byte tokenizer), on v5p:
#
#   python -m eqx_longctx.plan --model llama --preset llama3.1-8b --seq 1048576 --batch 1 \
#       --mesh context=64 --fsdp-axes context --train --set compute_dtype=bfloat16 \
#       --set vocab_size=259 --memory-budget-gib 95
#
#   train step: llama llama3.1-8b, batch 1 x seq 1048576 on mesh context=64 (weights split
#   over fsdp axes context); per device 1 x 16384 tokens; parameters float32, compute bfloat16
#   strategy    remat    params   grads    opt state  batch    activations  layer bwd  (attention)  logits    device    host   time
#   all_gather  none     417 MiB  417 MiB  834 MiB    320 KiB  295 GiB      21.6 GiB   20.8 GiB     50.6 MiB  318 GiB   0 B    12 s
#   all_gather  dots     417 MiB  417 MiB  834 MiB    320 KiB  42.3 GiB     27.2 GiB   20.8 GiB     50.6 MiB  71.1 GiB  0 B    13.4 s
#   all_gather  offload  417 MiB  417 MiB  834 MiB    320 KiB  4.02 MiB     27.2 GiB   20.8 GiB     50.6 MiB  28.9 GiB  4 GiB  15.7 s
#   all_gather  full     417 MiB  417 MiB  834 MiB    320 KiB  4 GiB        27.2 GiB   20.8 GiB     50.6 MiB  32.9 GiB  0 B    15.7 s
#   ring        none     417 MiB  417 MiB  834 MiB    320 KiB  169 GiB      2.63 GiB   1.82 GiB     50.6 MiB  173 GiB   0 B    11.8 s
#   ring        dots     417 MiB  417 MiB  834 MiB    320 KiB  42.3 GiB     8.3 GiB    1.82 GiB     50.6 MiB  52.2 GiB  0 B    13.2 s
#   ring        offload  417 MiB  417 MiB  834 MiB    320 KiB  4.02 MiB     8.3 GiB    1.82 GiB     50.6 MiB  9.94 GiB  4 GiB  15.5 s
#   ring        full     417 MiB  417 MiB  834 MiB    320 KiB  4 GiB        8.3 GiB    1.82 GiB     50.6 MiB  13.9 GiB  0 B    15.5 s
#   budget 95 GiB: chosen ring, remat='dots' (the fastest predicted step that fits 95 GiB (52.2 GiB per device))
#
# and with --memory-budget-gib 32 (v6e):
#
#   budget 32 GiB: chosen ring, remat='offload' (the fastest predicted step that fits 32 GiB (9.94 GiB per device))
#
# (`--json` prints the same as one object: "chosen": {"strategy": "ring", "remat": "dots"},
# "predicted_bytes_per_device": 56033499136.) The budget is the whole HBM: leave a few GiB
# for XLA's runtime. Data: the Python standard library (all of it, ~12 MB: about a dozen
# 1M-token rows, so this is a systems recipe; pass --data FOLDER or --data hf:DATASET for a
# real corpus).

case "${SLICE:-v5p}" in
  v5p) ACCELERATOR=v5p-128 DEVICES=64 REMAT=dots ;;    # 64 chips, 95 GiB each
  v6e) ACCELERATOR=v6e-64 DEVICES=64 REMAT=offload ;;  # 64 chips, 32 GiB each
  *) echo "SLICE must be v5p or v6e; got SLICE=$SLICE" >&2; return 2 2>/dev/null || exit 2 ;;
esac
FLAGS="--model llama --preset llama3.1-8b --seq-len 1048576 --batch-size 1 \
  --devices $DEVICES --mesh context=$DEVICES --fsdp-axes context \
  --strategy ring --load-balance zigzag --remat $REMAT --override compute_dtype=bfloat16 \
  --steps 200 --lr 3e-4 --warmup-steps 10 --max-bytes 100000000 \
  --eval-every 50 --eval-batches 1 --final-eval-batches 1 --checkpoint-every 50"

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  echo "on each of the $ACCELERATOR workers: python3 -m eqx_longctx.train $FLAGS --run-dir RUN_DIR"
fi
