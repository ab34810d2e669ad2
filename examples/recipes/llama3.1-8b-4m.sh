# Recipe: Llama 3.1 8B (the llama3.1-8b preset, byte vocabulary) on one sequence of 4M
# (4,194,304) tokens, on a v5p-64 (CHIPS=32) or v5p-128 (CHIPS=64, the default) slice.
#
#   RECIPE=examples/recipes/llama3.1-8b-4m.sh SLICE=v5p CHIPS=64 examples/cloud_tpu.sh create
#   RECIPE=examples/recipes/llama3.1-8b-4m.sh SLICE=v5p CHIPS=64 examples/cloud_tpu.sh setup
#   RECIPE=examples/recipes/llama3.1-8b-4m.sh SLICE=v5p CHIPS=64 examples/cloud_tpu.sh train
#   CHIPS=32 bash examples/recipes/llama3.1-8b-4m.sh      # print the command every worker runs
#
# Same entry point as the laptop main job: `python -m eqx_longctx.train`, one process per
# host; --devices is the slice's chip count. DATA=FOLDER or DATA=hf:DATASET adds --data
# (default: the Python standard library, ~12 MB: about three 4M-token rows, so this is a
# systems recipe). A step takes minutes, hence 50 steps and a checkpoint every 5.
#
# Mesh: context=CHIPS with the weights, gradients and AdamW state split over it (--fsdp-axes
# context, ZeRO-3): 131,072 tokens per chip on 32 chips, 65,536 on 64.
# Strategy: ring in a zig-zag layout. All-gather's layer backward holds every key and value
# (103-125 GiB per chip: it cannot fit); Ulysses is capped at the 8 key-value heads (on 32
# chips the planner prices it too: 1.5 GiB more than ring, and no faster).
# Remat: `offload` (each layer's input kept in host memory, everything else recomputed), the
# fastest that fits: `none` keeps 612-1199 GiB of activations per chip and `dots` 168-336
# GiB. On 64 chips: 29.5 GiB on the chip and 16 GiB of host memory, 715 s per step; on 32:
# 57 GiB and 32 GiB of host memory, 1.43e3 s. `full` is as fast by the planner's count and
# keeps no host memory (45.5 GiB on 64 chips, 89 GiB on 32: 6 GiB from the budget).
#
# The planner, for exactly these runs (the preset's 128,256-token vocabulary: the planner's
# CLI has no byte tokenizer, so its output head and logits are larger than the run's 259
# tokens: an upper bound), on 64 chips:
#
#   python -m eqx_longctx.plan --model llama --preset llama3.1-8b --seq-len 4194304 \
#       --batch-size 1 --mesh context=64 --fsdp-axes context --train \
#       --override compute_dtype=bfloat16 --chip v5p
#
#   train step: llama llama3.1-8b, batch 1 x seq 4194304 on mesh context=64 (weights split over fsdp axes context); per device 1 x 65536 tokens; parameters float32, compute bfloat16; bytes per device
#   strategy    remat    params   grads    opt state  batch     activations  layer bwd  (attention)  logits   device    host    FLOPs/dev  time   (attn time)  MFU
#   all_gather  none     480 MiB  480 MiB  959 MiB    1.25 MiB  1117 GiB     83.8 GiB   83 GiB       5.2 GiB  1203 GiB  0 B     2.55e+17   567 s  560 s        84.2%
#   all_gather  dots     480 MiB  480 MiB  959 MiB    1.25 MiB  168 GiB      103 GiB    83 GiB       5.2 GiB  273 GiB   0 B     3.27e+17   724 s  717 s        65.9%
#   all_gather  offload  480 MiB  480 MiB  959 MiB    1.25 MiB  40 MiB       103 GiB    83 GiB       5.2 GiB  105 GiB   16 GiB  3.28e+17   726 s  717 s        65.7%
#   all_gather  full     480 MiB  480 MiB  959 MiB    1.25 MiB  16 GiB       103 GiB    83 GiB       5.2 GiB  121 GiB   0 B     3.28e+17   726 s  717 s        65.7%
#   ring        none     480 MiB  480 MiB  959 MiB    1.25 MiB  612 GiB      8.08 GiB   7.27 GiB     5.2 GiB  622 GiB   0 B     2.55e+17   556 s  550 s        85.8%
#   ring        dots     480 MiB  480 MiB  959 MiB    1.25 MiB  168 GiB      27.6 GiB   7.27 GiB     5.2 GiB  198 GiB   0 B     3.27e+17   713 s  707 s        66.9%
#   ring        offload  480 MiB  480 MiB  959 MiB    1.25 MiB  40 MiB       27.6 GiB   7.27 GiB     5.2 GiB  29.5 GiB  16 GiB  3.28e+17   715 s  707 s        66.7%
#   ring        full     480 MiB  480 MiB  959 MiB    1.25 MiB  16 GiB       27.6 GiB   7.27 GiB     5.2 GiB  45.5 GiB  0 B     3.28e+17   715 s  707 s        66.7%
#   device = params + grads + opt state + batch + activations + max(layer bwd, logits) (opt state only at the update when offloaded); host = offloaded activations and state
#   time = every layer's matmuls and attention (recomputation and exposed communication included) on the busiest device at 459 TFLOP/s and 100 GB/s per link (v5p); model FLOPs per step 1.4e+19 (6 x active params x tokens + causal attention + linear attention's chunked form, no recomputation); MFU = model FLOPs / (time x 64 devices x FLOP/s)
#   32 global layers: ring, 63.1 GiB per device per layer (forward + backward)
#   budget 95 GiB: chosen ring, remat='offload' (the fastest predicted step that fits 95 GiB (29.5 GiB per device))
#
# and on 32 chips (--mesh context=32):
#
#   train step: llama llama3.1-8b, batch 1 x seq 4194304 on mesh context=32 (weights split over fsdp axes context); per device 1 x 131072 tokens; parameters float32, compute bfloat16; bytes per device
#   strategy    remat    params   grads    opt state  batch    activations  layer bwd  (attention)  logits   device    host    FLOPs/dev  time        (attn time)  MFU
#   all_gather  none     958 MiB  958 MiB  1.87 GiB   2.5 MiB  1696 GiB     86.8 GiB   86 GiB       5.2 GiB  1786 GiB  0 B     5.11e+17   1.12e+03 s  1.11e+03 s   85.0%
#   all_gather  dots     958 MiB  958 MiB  1.87 GiB   2.5 MiB  336 GiB      125 GiB    86 GiB       5.2 GiB  465 GiB   0 B     6.55e+17   1.44e+03 s  1.42e+03 s   66.4%
#   all_gather  offload  958 MiB  958 MiB  1.87 GiB   2.5 MiB  80 MiB       125 GiB    86 GiB       5.2 GiB  129 GiB   32 GiB  6.57e+17   1.44e+03 s  1.42e+03 s   66.2%
#   all_gather  full     958 MiB  958 MiB  1.87 GiB   2.5 MiB  32.1 GiB     125 GiB    86 GiB       5.2 GiB  161 GiB   0 B     6.57e+17   1.44e+03 s  1.42e+03 s   66.2%
#   ulysses     none     958 MiB  958 MiB  1.87 GiB   2.5 MiB  1199 GiB     16.8 GiB   16 GiB       5.2 GiB  1219 GiB  0 B     5.11e+17   1.11e+03 s  1.1e+03 s    85.6%
#   ulysses     dots     958 MiB  958 MiB  1.87 GiB   2.5 MiB  336 GiB      54.7 GiB   16 GiB       5.2 GiB  395 GiB   0 B     6.55e+17   1.43e+03 s  1.42e+03 s   66.8%
#   ulysses     offload  958 MiB  958 MiB  1.87 GiB   2.5 MiB  80 MiB       54.7 GiB   16 GiB       5.2 GiB  58.5 GiB  32 GiB  6.57e+17   1.43e+03 s  1.42e+03 s   66.6%
#   ulysses     full     958 MiB  958 MiB  1.87 GiB   2.5 MiB  32.1 GiB     54.7 GiB   16 GiB       5.2 GiB  90.5 GiB  0 B     6.57e+17   1.43e+03 s  1.42e+03 s   66.6%
#   ring        none     958 MiB  958 MiB  1.87 GiB   2.5 MiB  1199 GiB     15.3 GiB   14.5 GiB     5.2 GiB  1218 GiB  0 B     5.11e+17   1.11e+03 s  1.1e+03 s    85.8%
#   ring        dots     958 MiB  958 MiB  1.87 GiB   2.5 MiB  336 GiB      53.2 GiB   14.5 GiB     5.2 GiB  393 GiB   0 B     6.55e+17   1.43e+03 s  1.41e+03 s   66.9%
#   ring        offload  958 MiB  958 MiB  1.87 GiB   2.5 MiB  80 MiB       53.2 GiB   14.5 GiB     5.2 GiB  57 GiB    32 GiB  6.57e+17   1.43e+03 s  1.41e+03 s   66.7%
#   ring        full     958 MiB  958 MiB  1.87 GiB   2.5 MiB  32.1 GiB     53.2 GiB   14.5 GiB     5.2 GiB  89 GiB    0 B     6.57e+17   1.43e+03 s  1.41e+03 s   66.7%
#   device = params + grads + opt state + batch + activations + max(layer bwd, logits) (opt state only at the update when offloaded); host = offloaded activations and state
#   time = every layer's matmuls and attention (recomputation and exposed communication included) on the busiest device at 459 TFLOP/s and 100 GB/s per link (v5p); model FLOPs per step 1.4e+19 (6 x active params x tokens + causal attention + linear attention's chunked form, no recomputation); MFU = model FLOPs / (time x 32 devices x FLOP/s)
#   32 global layers: ring, 62.1 GiB per device per layer (forward + backward)
#   budget 95 GiB: chosen ring, remat='offload' (the fastest predicted step that fits 95 GiB (57 GiB per device))
#
# Chosen: ring, remat offload on both (CHIPS=64: 29.5 GiB + 16 GiB host, 715 s per step;
# CHIPS=32: 57 GiB + 32 GiB host, 1.43e3 s). The budget is the whole HBM: leave a few GiB for
# XLA's runtime. tests/test_pod_recipes.py plans every slice in SLICES.

SLICES="v5p:32 v5p:64"  # SLICE:CHIPS pairs this recipe was planned for
case "${SLICE:-v5p}:${CHIPS:-64}" in
  v5p:32) ACCELERATOR=v5p-64 DEVICES=32 ;;   # 32 chips, 95 GiB each
  v5p:64) ACCELERATOR=v5p-128 DEVICES=64 ;;  # 64 chips, 95 GiB each
  *) echo "SLICE=v5p with CHIPS=32 or 64; got SLICE=${SLICE:-v5p} CHIPS=${CHIPS:-64}" >&2
    return 2 2>/dev/null || exit 2 ;;
esac
FLAGS="--model llama --preset llama3.1-8b --seq-len 4194304 --batch-size 1 \
  --devices $DEVICES --mesh context=$DEVICES --fsdp-axes context \
  --strategy ring --load-balance zigzag --remat offload --override compute_dtype=bfloat16 \
  --steps 50 --lr 3e-4 --warmup-steps 5 --max-bytes 100000000 \
  --eval-every 25 --eval-batches 1 --final-eval-batches 1 --checkpoint-every 5${DATA:+ --data $DATA}"

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  echo "on each of the $ACCELERATOR workers: python3 -m eqx_longctx.train $FLAGS --run-dir RUN_DIR"
fi
