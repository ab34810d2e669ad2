# Recipe: DeepSeek-V2-Lite (the deepseek-v2-lite preset, byte vocabulary: MLA + 64 routed
# experts) on one sequence of 256K tokens.
#
#   RECIPE=examples/recipes/deepseek-v2-lite-256k.sh SLICE=v5p examples/cloud_tpu.sh create
#   RECIPE=examples/recipes/deepseek-v2-lite-256k.sh SLICE=v5p examples/cloud_tpu.sh setup
#   RECIPE=examples/recipes/deepseek-v2-lite-256k.sh SLICE=v5p examples/cloud_tpu.sh train
#   bash examples/recipes/deepseek-v2-lite-256k.sh     # print the command every worker runs
#
# Same entry point as the laptop main job: `python -m eqx_longctx.train`, one process per
# host; --devices is the slice's chip count.
#
# Mesh: context=16 on v5p (32 on v6e) with the weights, gradients and AdamW state split over
# it (--fsdp-axes context): 16,384 (8,192) tokens and 1/16 (1/32) of the 16B parameters' 250
# GB of float32 state per chip. No expert axis: expert parallelism splits the batch over that
# axis, and this run has one sequence (the experts are split by FSDP instead). No tensor
# axis: multi-head latent attention replicates its up-projections, so it cannot split heads.
# Strategy: ring in a zig-zag layout, the fastest predicted. Ulysses (all-to-all of the 16
# heads over the context axis) is 0.02 s slower and all-gather's layer backward needs 28.5
# GiB against ring's 18.3.
# Remat: `dots` (keep the projections' outputs, recompute the rest), the fastest that fits:
# `none` keeps 177 GiB of activations per chip. On v5p: 48.3 GiB of 95. On v6e (32 GiB),
# context=32 halves every part: 27.8 GiB; if XLA's own buffers push that past the chip,
# `--remat offload` needs 20.3 GiB (+ 0.8 GiB host) for 0.4 s more per step.
#
# The planner, for exactly this run (vocab_size=259: the CLI's byte tokenizer; ragged_dot:
# what grouped_matmul="auto" picks on TPU), on v5p:
#
#   python -m eqx_longctx.plan --model deepseek --preset deepseek-v2-lite --seq 262144 \
#       --batch 1 --mesh context=16 --fsdp-axes context --train --set compute_dtype=bfloat16 \
#       --set vocab_size=259 --set grouped_matmul=ragged_dot --memory-budget-gib 95
#
#   train step: deepseek deepseek-v2-lite, batch 1 x seq 262144 on mesh context=16 (weights
#   split over fsdp axes context); per device 1 x 16384 tokens; parameters float32, compute bfloat16
#   strategy    remat    params    grads     opt state  batch    activations  layer bwd  (attention)  logits    device    host      time
#   all_gather  none     3.76 GiB  3.76 GiB  7.52 GiB   320 KiB  240 GiB      15.2 GiB   13 GiB       45.5 MiB  270 GiB   0 B       3.1 s
#   all_gather  dots     3.76 GiB  3.76 GiB  7.52 GiB   320 KiB  15 GiB       28.5 GiB   13 GiB       45.5 MiB  58.6 GiB  0 B       3.32 s
#   all_gather  offload  3.76 GiB  3.76 GiB  7.52 GiB   320 KiB  3.38 MiB     28.5 GiB   13 GiB       45.5 MiB  43.6 GiB  1.69 GiB  4.06 s
#   all_gather  full     3.76 GiB  3.76 GiB  7.52 GiB   320 KiB  1.69 GiB     28.5 GiB   13 GiB       45.5 MiB  45.3 GiB  0 B       4.06 s
#   ulysses     none     3.76 GiB  3.76 GiB  7.52 GiB   320 KiB  177 GiB      3.49 GiB   1.31 GiB     45.5 MiB  195 GiB   0 B       3.01 s
#   ulysses     dots     3.76 GiB  3.76 GiB  7.52 GiB   320 KiB  15 GiB       16.8 GiB   1.31 GiB     45.5 MiB  46.8 GiB  0 B       3.24 s
#   ulysses     offload  3.76 GiB  3.76 GiB  7.52 GiB   320 KiB  3.38 MiB     16.8 GiB   1.31 GiB     45.5 MiB  31.9 GiB  1.69 GiB  3.97 s
#   ulysses     full     3.76 GiB  3.76 GiB  7.52 GiB   320 KiB  1.69 GiB     16.8 GiB   1.31 GiB     45.5 MiB  33.5 GiB  0 B       3.97 s
#   ring        none     3.76 GiB  3.76 GiB  7.52 GiB   320 KiB  177 GiB      4.93 GiB   2.75 GiB     45.5 MiB  197 GiB   0 B       3 s
#   ring        dots     3.76 GiB  3.76 GiB  7.52 GiB   320 KiB  15 GiB       18.3 GiB   2.75 GiB     45.5 MiB  48.3 GiB  0 B       3.22 s
#   ring        offload  3.76 GiB  3.76 GiB  7.52 GiB   320 KiB  3.38 MiB     18.3 GiB   2.75 GiB     45.5 MiB  33.3 GiB  1.69 GiB  3.96 s
#   ring        full     3.76 GiB  3.76 GiB  7.52 GiB   320 KiB  1.69 GiB     18.3 GiB   2.75 GiB     45.5 MiB  35 GiB    0 B       3.96 s
#   budget 95 GiB: chosen ring, remat='dots' (the fastest predicted step that fits 95 GiB (48.3 GiB per device))
#
# and on v6e, --mesh context=32 --memory-budget-gib 32:
#
#   ring        dots     1.98 GiB  1.98 GiB  3.97 GiB   160 KiB  7.5 GiB      12.4 GiB   1.38 GiB     25.3 MiB  27.8 GiB  0 B      1.61 s
#   ring        offload  1.98 GiB  1.98 GiB  3.97 GiB   160 KiB  1.69 MiB     12.4 GiB   1.38 GiB     25.3 MiB  20.3 GiB  864 MiB  1.98 s
#   budget 32 GiB: chosen ring, remat='dots' (the fastest predicted step that fits 32 GiB (27.8 GiB per device))
#
# Data: the Python standard library (all of it, ~12 MB: about 45 rows of 256K tokens; pass
# --data FOLDER or --data hf:DATASET for a real corpus).

case "${SLICE:-v5p}" in
  v5p) ACCELERATOR=v5p-32 DEVICES=16 ;;  # 16 chips, 95 GiB each
  v6e) ACCELERATOR=v6e-32 DEVICES=32 ;;  # 32 chips, 32 GiB each
  *) echo "SLICE must be v5p or v6e; got SLICE=$SLICE" >&2; return 2 2>/dev/null || exit 2 ;;
esac
FLAGS="--model deepseek --preset deepseek-v2-lite --seq-len 262144 --batch-size 1 \
  --devices $DEVICES --mesh context=$DEVICES --fsdp-axes context \
  --strategy ring --load-balance zigzag --remat dots --override compute_dtype=bfloat16 \
  --steps 200 --lr 3e-4 --warmup-steps 10 --max-bytes 100000000 \
  --eval-every 50 --eval-batches 1 --final-eval-batches 1 --checkpoint-every 50"

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  echo "on each of the $ACCELERATOR workers: python3 -m eqx_longctx.train $FLAGS --run-dir RUN_DIR"
fi
