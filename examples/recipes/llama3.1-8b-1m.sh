# Recipe: Llama 3.1 8B (the llama3.1-8b preset, byte vocabulary) on one sequence of 1M
# (1,048,576) tokens, on a v5p-64 (CHIPS=32), a v5p-128 (CHIPS=64, the default) or a v6e-64
# (SLICE=v6e) slice.
#
#   RECIPE=examples/recipes/llama3.1-8b-1m.sh SLICE=v5p CHIPS=64 examples/cloud_tpu.sh create
#   RECIPE=examples/recipes/llama3.1-8b-1m.sh SLICE=v5p CHIPS=64 examples/cloud_tpu.sh setup
#   RECIPE=examples/recipes/llama3.1-8b-1m.sh SLICE=v5p CHIPS=64 examples/cloud_tpu.sh train
#   CHIPS=32 bash examples/recipes/llama3.1-8b-1m.sh      # print the command every worker runs
#
# Same entry point as the laptop main job: `python -m eqx_longctx.train`, one process per
# host; --devices is the slice's chip count. DATA=FOLDER or DATA=hf:DATASET adds --data
# (default: the Python standard library, ~12 MB: about a dozen 1M-token rows, so this is a
# systems recipe).
#
# Mesh: context=CHIPS with the weights, gradients and AdamW state split over it (--fsdp-axes
# context, ZeRO-3): every chip holds 1/CHIPS of the 1,048,576 tokens (32,768 on 32 chips,
# 16,384 on 64) and of the 8B parameters' 128 GB of float32 state.
# Strategy: ring in a zig-zag layout. All-gather would gather every key and value (its layer
# backward needs 27.4 GiB on 64 chips against ring's 8.43 GiB); Ulysses is capped at the 8
# key-value heads, and Ulysses x ring meshes (ulysses=4 or 8) chose ring, at the same time.
# Remat: the fastest policy that fits the chip.
# - v5p, CHIPS=64: `dots` (keep the projections' outputs, recompute the rest): 52.3 GiB of
#   95, 45.8 s per step, where `none` would need 180 GiB.
# - v5p, CHIPS=32: `dots` would need 103 GiB (84 GiB of it activations); `offload` (each layer's
#   input kept in host memory, everything else recomputed) needs 18.6 GiB on the chip and
#   8 GiB of host memory: 92.7 s per step, as fast as `full` (26.6 GiB).
# - v6e (32 GiB), 64 chips: `offload`, 10.3 GiB and 4 GiB of host memory, 23.2 s per step.
#
# The planner, for exactly these runs (the preset's 128,256-token vocabulary: the planner's
# CLI has no byte tokenizer, so its output head and logits are larger than the run's 259
# tokens: an upper bound), on 64 v5p chips:
#
#   python -m eqx_longctx.plan --model llama --preset llama3.1-8b --seq-len 1048576 \
#       --batch-size 1 --mesh context=64 --fsdp-axes context --train \
#       --override compute_dtype=bfloat16 --chip v5p
#
#   train step: llama llama3.1-8b, batch 1 x seq 1048576 on mesh context=64 (weights split over fsdp axes context); per device 1 x 16384 tokens; parameters float32, compute bfloat16; bytes per device
#   strategy    remat    params   grads    opt state  batch    activations  layer bwd  (attention)  logits   device    host   FLOPs/dev  time    (attn time)  MFU
#   all_gather  none     480 MiB  480 MiB  959 MiB    320 KiB  299 GiB      21.6 GiB   20.8 GiB     5.2 GiB  322 GiB   0 B    1.65e+16   38.7 s  37.1 s       80.2%
#   all_gather  dots     480 MiB  480 MiB  959 MiB    320 KiB  42 GiB       27.4 GiB   20.8 GiB     5.2 GiB  71.3 GiB  0 B    2.1e+16    48.5 s  46.9 s       64.0%
#   all_gather  offload  480 MiB  480 MiB  959 MiB    320 KiB  10 MiB       27.4 GiB   20.8 GiB     5.2 GiB  29.3 GiB  4 GiB  2.13e+16   49.1 s  46.9 s       63.3%
#   all_gather  full     480 MiB  480 MiB  959 MiB    320 KiB  4.01 GiB     27.4 GiB   20.8 GiB     5.2 GiB  33.3 GiB  0 B    2.13e+16   49.1 s  46.9 s       63.3%
#   ring        none     480 MiB  480 MiB  959 MiB    320 KiB  173 GiB      2.63 GiB   1.82 GiB     5.2 GiB  180 GiB   0 B    1.65e+16   36 s    34.4 s       86.2%
#   ring        dots     480 MiB  480 MiB  959 MiB    320 KiB  42 GiB       8.43 GiB   1.82 GiB     5.2 GiB  52.3 GiB  0 B    2.1e+16    45.8 s  44.2 s       67.8%
#   ring        offload  480 MiB  480 MiB  959 MiB    320 KiB  10 MiB       8.43 GiB   1.82 GiB     5.2 GiB  10.3 GiB  4 GiB  2.13e+16   46.4 s  44.2 s       66.9%
#   ring        full     480 MiB  480 MiB  959 MiB    320 KiB  4.01 GiB     8.43 GiB   1.82 GiB     5.2 GiB  14.3 GiB  0 B    2.13e+16   46.4 s  44.2 s       66.9%
#   device = params + grads + opt state + batch + activations + max(layer bwd, logits) (opt state only at the update when offloaded); host = offloaded activations and state
#   time = every layer's matmuls and attention (recomputation and exposed communication included) on the busiest device at 459 TFLOP/s and 100 GB/s per link (v5p); model FLOPs per step 9.12e+17 (6 x active params x tokens + causal attention + linear attention's chunked form, no recomputation); MFU = model FLOPs / (time x 64 devices x FLOP/s)
#   32 global layers: ring, 15.8 GiB per device per layer (forward + backward)
#   budget 95 GiB: chosen ring, remat='dots' (the fastest predicted step that fits 95 GiB (52.3 GiB per device))
#
# on 32 v5p chips (--mesh context=32):
#
#   train step: llama llama3.1-8b, batch 1 x seq 1048576 on mesh context=32 (weights split over fsdp axes context); per device 1 x 32768 tokens; parameters float32, compute bfloat16; bytes per device
#   strategy    remat    params   grads    opt state  batch    activations  layer bwd  (attention)  logits   device    host   FLOPs/dev  time    (attn time)  MFU
#   all_gather  none     958 MiB  958 MiB  1.87 GiB   640 KiB  443 GiB      22.3 GiB   21.5 GiB     5.2 GiB  469 GiB   0 B    3.31e+16   74.7 s  71.4 s       83.1%
#   all_gather  dots     958 MiB  958 MiB  1.87 GiB   640 KiB  84 GiB       32.7 GiB   21.5 GiB     5.2 GiB  120 GiB   0 B    4.21e+16   94.3 s  91 s         65.8%
#   all_gather  offload  958 MiB  958 MiB  1.87 GiB   640 KiB  20 MiB       32.7 GiB   21.5 GiB     5.2 GiB  36.5 GiB  8 GiB  4.26e+16   95.4 s  91 s         65.1%
#   all_gather  full     958 MiB  958 MiB  1.87 GiB   640 KiB  8.02 GiB     32.7 GiB   21.5 GiB     5.2 GiB  44.5 GiB  0 B    4.26e+16   95.4 s  91 s         65.1%
#   ulysses     none     958 MiB  958 MiB  1.87 GiB   640 KiB  319 GiB      4.82 GiB   4.01 GiB     5.2 GiB  328 GiB   0 B    3.31e+16   72.7 s  69.4 s       85.4%
#   ulysses     dots     958 MiB  958 MiB  1.87 GiB   640 KiB  84 GiB       15.2 GiB   4.01 GiB     5.2 GiB  103 GiB   0 B    4.21e+16   92.3 s  89 s         67.3%
#   ulysses     offload  958 MiB  958 MiB  1.87 GiB   640 KiB  20 MiB       15.2 GiB   4.01 GiB     5.2 GiB  19 GiB    8 GiB  4.26e+16   93.4 s  89 s         66.5%
#   ulysses     full     958 MiB  958 MiB  1.87 GiB   640 KiB  8.02 GiB     15.2 GiB   4.01 GiB     5.2 GiB  27 GiB    0 B    4.26e+16   93.4 s  89 s         66.5%
#   ring        none     958 MiB  958 MiB  1.87 GiB   640 KiB  319 GiB      4.45 GiB   3.63 GiB     5.2 GiB  328 GiB   0 B    3.31e+16   72 s    68.7 s       86.2%
#   ring        dots     958 MiB  958 MiB  1.87 GiB   640 KiB  84 GiB       14.8 GiB   3.63 GiB     5.2 GiB  103 GiB   0 B    4.21e+16   91.6 s  88.3 s       67.8%
#   ring        offload  958 MiB  958 MiB  1.87 GiB   640 KiB  20 MiB       14.8 GiB   3.63 GiB     5.2 GiB  18.6 GiB  8 GiB  4.26e+16   92.7 s  88.3 s       66.9%
#   ring        full     958 MiB  958 MiB  1.87 GiB   640 KiB  8.02 GiB     14.8 GiB   3.63 GiB     5.2 GiB  26.6 GiB  0 B    4.26e+16   92.7 s  88.3 s       66.9%
#   device = params + grads + opt state + batch + activations + max(layer bwd, logits) (opt state only at the update when offloaded); host = offloaded activations and state
#   time = every layer's matmuls and attention (recomputation and exposed communication included) on the busiest device at 459 TFLOP/s and 100 GB/s per link (v5p); model FLOPs per step 9.12e+17 (6 x active params x tokens + causal attention + linear attention's chunked form, no recomputation); MFU = model FLOPs / (time x 32 devices x FLOP/s)
#   32 global layers: ring, 15.5 GiB per device per layer (forward + backward)
#   budget 95 GiB: chosen ring, remat='offload' (the fastest predicted step that fits 95 GiB (18.6 GiB per device))
#
# and on 64 v6e chips (--mesh context=64 --chip v6e):
#
#   train step: llama llama3.1-8b, batch 1 x seq 1048576 on mesh context=64 (weights split over fsdp axes context); per device 1 x 16384 tokens; parameters float32, compute bfloat16; bytes per device
#   strategy    remat    params   grads    opt state  batch    activations  layer bwd  (attention)  logits   device    host   FLOPs/dev  time    (attn time)  MFU
#   all_gather  none     480 MiB  480 MiB  959 MiB    320 KiB  299 GiB      21.6 GiB   20.8 GiB     5.2 GiB  322 GiB   0 B    1.65e+16   20.7 s  19.9 s       74.9%
#   all_gather  dots     480 MiB  480 MiB  959 MiB    320 KiB  42 GiB       27.4 GiB   20.8 GiB     5.2 GiB  71.3 GiB  0 B    2.1e+16    25.6 s  24.8 s       60.6%
#   all_gather  offload  480 MiB  480 MiB  959 MiB    320 KiB  10 MiB       27.4 GiB   20.8 GiB     5.2 GiB  29.3 GiB  4 GiB  2.13e+16   25.9 s  24.8 s       59.9%
#   all_gather  full     480 MiB  480 MiB  959 MiB    320 KiB  4.01 GiB     27.4 GiB   20.8 GiB     5.2 GiB  33.3 GiB  0 B    2.13e+16   25.9 s  24.8 s       59.9%
#   ring        none     480 MiB  480 MiB  959 MiB    320 KiB  173 GiB      2.63 GiB   1.82 GiB     5.2 GiB  180 GiB   0 B    1.65e+16   18 s    17.2 s       86.2%
#   ring        dots     480 MiB  480 MiB  959 MiB    320 KiB  42 GiB       8.43 GiB   1.82 GiB     5.2 GiB  52.3 GiB  0 B    2.1e+16    22.9 s  22.1 s       67.8%
#   ring        offload  480 MiB  480 MiB  959 MiB    320 KiB  10 MiB       8.43 GiB   1.82 GiB     5.2 GiB  10.3 GiB  4 GiB  2.13e+16   23.2 s  22.1 s       66.9%
#   ring        full     480 MiB  480 MiB  959 MiB    320 KiB  4.01 GiB     8.43 GiB   1.82 GiB     5.2 GiB  14.3 GiB  0 B    2.13e+16   23.2 s  22.1 s       66.9%
#   device = params + grads + opt state + batch + activations + max(layer bwd, logits) (opt state only at the update when offloaded); host = offloaded activations and state
#   time = every layer's matmuls and attention (recomputation and exposed communication included) on the busiest device at 918 TFLOP/s and 100 GB/s per link (v6e); model FLOPs per step 9.12e+17 (6 x active params x tokens + causal attention + linear attention's chunked form, no recomputation); MFU = model FLOPs / (time x 64 devices x FLOP/s)
#   32 global layers: ring, 15.8 GiB per device per layer (forward + backward)
#   budget 32 GiB: chosen ring, remat='offload' (the fastest predicted step that fits 32 GiB (10.3 GiB per device))
#
# (`--json` prints the same as one object.) Chosen: v5p CHIPS=64 ring, remat dots (52.3 GiB,
# 45.8 s per step); v5p CHIPS=32 ring, remat offload (18.6 GiB + 8 GiB host, 92.7 s); v6e
# ring, remat offload (10.3 GiB + 4 GiB host, 23.2 s). The budget is the whole HBM: leave a
# few GiB for XLA's runtime. tests/test_pod_recipes.py plans every slice in SLICES.

SLICES="v5p:32 v5p:64 v6e:64"  # SLICE:CHIPS pairs this recipe was planned for
case "${SLICE:-v5p}:${CHIPS:-64}" in
  v5p:32) ACCELERATOR=v5p-64 DEVICES=32 REMAT=offload ;;   # 32 chips, 95 GiB each
  v5p:64) ACCELERATOR=v5p-128 DEVICES=64 REMAT=dots ;;     # 64 chips, 95 GiB each
  v6e:64) ACCELERATOR=v6e-64 DEVICES=64 REMAT=offload ;;   # 64 chips, 32 GiB each
  *) echo "SLICE=v5p with CHIPS=32 or 64, or SLICE=v6e with CHIPS=64; got" \
    "SLICE=${SLICE:-v5p} CHIPS=${CHIPS:-64}" >&2; return 2 2>/dev/null || exit 2 ;;
esac
FLAGS="--model llama --preset llama3.1-8b --seq-len 1048576 --batch-size 1 \
  --devices $DEVICES --mesh context=$DEVICES --fsdp-axes context \
  --strategy ring --load-balance zigzag --remat $REMAT --override compute_dtype=bfloat16 \
  --steps 200 --lr 3e-4 --warmup-steps 10 --max-bytes 100000000 \
  --eval-every 50 --eval-batches 1 --final-eval-batches 1 --checkpoint-every 50${DATA:+ --data $DATA}"

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  echo "on each of the $ACCELERATOR workers: python3 -m eqx_longctx.train $FLAGS --run-dir RUN_DIR"
fi
