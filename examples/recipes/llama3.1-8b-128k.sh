# Recipe: Llama 3.1 8B (the llama3.1-8b preset, byte vocabulary) on one sequence of 128K
# (131,072) tokens, on a v5p-64 (CHIPS=32) or v5p-128 (CHIPS=64, the default) slice.
#
#   RECIPE=examples/recipes/llama3.1-8b-128k.sh SLICE=v5p CHIPS=64 examples/cloud_tpu.sh create
#   RECIPE=examples/recipes/llama3.1-8b-128k.sh SLICE=v5p CHIPS=64 examples/cloud_tpu.sh setup
#   RECIPE=examples/recipes/llama3.1-8b-128k.sh SLICE=v5p CHIPS=64 examples/cloud_tpu.sh train
#   CHIPS=32 bash examples/recipes/llama3.1-8b-128k.sh    # print the command every worker runs
#
# Same entry point as the laptop main job: `python -m eqx_longctx.train`, one process per
# host; --devices is the slice's chip count. DATA=FOLDER or DATA=hf:DATASET adds --data (default:
# the Python standard library, ~12 MB: about 90 rows of 128K tokens).
#
# Why, per slice (every chip on the one sequence; the weights, gradients and AdamW state
# split over every chip, --fsdp-axes, ZeRO-3: 958 MiB + 958 MiB + 1.87 GiB per chip on 32,
# half that on 64):
# - CHIPS=32: --mesh context=32, 4,096 tokens per chip. Ring in a zig-zag layout, remat
#   `none`: the fastest predicted step (1.49 s) and it fits, 71.6 GiB of 95. Ulysses is
#   0.08 s slower and all-gather 0.33 s; on Ulysses x ring meshes (ulysses=2 or 4) the
#   planner chose ring too. `dots` would need 19.5 GiB for 0.31 s more per step.
# - CHIPS=64: --mesh ulysses=2,context=32 (--fsdp-axes ulysses,context), 2,048 tokens per
#   chip. USP (an all-to-all of the heads over the ulysses pair, then a ring of 32 hops of
#   4,096 tokens where plain ring makes 64 of 2,048) with remat `none`: 0.758 s and
#   51.4 GiB, against ring's 0.883 s on the same mesh (0.764 s with ulysses=4, 0.768 s with
#   8); the planner prices USP's attention at 552 ms of the step, ring's at 677 ms.
#
# The planner, for exactly these runs (the preset's 128,256-token vocabulary: the planner's
# CLI has no byte tokenizer, so its output head and logits are larger than the run's 259
# tokens: an upper bound), on 32 chips:
#
#   python -m eqx_longctx.plan --model llama --preset llama3.1-8b --seq-len 131072 \
#       --batch-size 1 --mesh context=32 --fsdp-axes context --train \
#       --override compute_dtype=bfloat16 --chip v5p
#
#   train step: llama llama3.1-8b, batch 1 x seq 131072 on mesh context=32 (weights split over fsdp axes context); per device 1 x 4096 tokens; parameters float32, compute bfloat16; bytes per device
#   strategy    remat    params   grads    opt state  batch   activations  layer bwd  (attention)  logits   device    host   FLOPs/dev  time    (attn time)  MFU
#   all_gather  none     958 MiB  958 MiB  1.87 GiB   80 KiB  78.2 GiB     3.5 GiB    2.69 GiB     5.2 GiB  87.1 GiB  0 B    6.83e+14   1.82 s  1.41 s       72.6%
#   all_gather  dots     958 MiB  958 MiB  1.87 GiB   80 KiB  10.5 GiB     5.86 GiB   2.69 GiB     5.2 GiB  20.1 GiB  0 B    8.25e+14   2.13 s  1.72 s       62.1%
#   all_gather  offload  958 MiB  958 MiB  1.87 GiB   80 KiB  2.5 MiB      5.86 GiB   2.69 GiB     5.2 GiB  9.61 GiB  1 GiB  8.87e+14   2.27 s  1.72 s       58.3%
#   all_gather  full     958 MiB  958 MiB  1.87 GiB   80 KiB  1 GiB        5.86 GiB   2.69 GiB     5.2 GiB  10.6 GiB  0 B    8.87e+14   2.27 s  1.72 s       58.3%
#   ulysses     none     958 MiB  958 MiB  1.87 GiB   80 KiB  62.6 GiB     1.31 GiB   513 MiB      5.2 GiB  71.6 GiB  0 B    6.83e+14   1.57 s  1.16 s       84.1%
#   ulysses     dots     958 MiB  958 MiB  1.87 GiB   80 KiB  10.5 GiB     3.68 GiB   513 MiB      5.2 GiB  19.5 GiB  0 B    8.25e+14   1.88 s  1.47 s       70.3%
#   ulysses     offload  958 MiB  958 MiB  1.87 GiB   80 KiB  2.5 MiB      3.68 GiB   513 MiB      5.2 GiB  8.95 GiB  1 GiB  8.87e+14   2.02 s  1.47 s       65.5%
#   ulysses     full     958 MiB  958 MiB  1.87 GiB   80 KiB  1 GiB        3.68 GiB   513 MiB      5.2 GiB  9.95 GiB  0 B    8.87e+14   2.02 s  1.47 s       65.5%
#   ring        none     958 MiB  958 MiB  1.87 GiB   80 KiB  62.6 GiB     1.27 GiB   465 MiB      5.2 GiB  71.6 GiB  0 B    6.83e+14   1.49 s  1.08 s       88.8%
#   ring        dots     958 MiB  958 MiB  1.87 GiB   80 KiB  10.5 GiB     3.63 GiB   465 MiB      5.2 GiB  19.5 GiB  0 B    8.25e+14   1.8 s   1.39 s       73.6%
#   ring        offload  958 MiB  958 MiB  1.87 GiB   80 KiB  2.5 MiB      3.63 GiB   465 MiB      5.2 GiB  8.95 GiB  1 GiB  8.87e+14   1.93 s  1.39 s       68.4%
#   ring        full     958 MiB  958 MiB  1.87 GiB   80 KiB  1 GiB        3.63 GiB   465 MiB      5.2 GiB  9.95 GiB  0 B    8.87e+14   1.93 s  1.39 s       68.4%
#   device = params + grads + opt state + batch + activations + max(layer bwd, logits) (opt state only at the update when offloaded); host = offloaded activations and state
#   time = every layer's matmuls and attention (recomputation and exposed communication included) on the busiest device at 459 TFLOP/s and 100 GB/s per link (v5p); model FLOPs per step 1.94e+16 (6 x active params x tokens + causal attention + linear attention's chunked form, no recomputation); MFU = model FLOPs / (time x 32 devices x FLOP/s)
#   32 global layers: ring, 1.94 GiB per device per layer (forward + backward)
#   budget 95 GiB: chosen ring, remat='none' (the fastest predicted step that fits 95 GiB (71.6 GiB per device))
#
# and on 64 chips:
#
#   python -m eqx_longctx.plan --model llama --preset llama3.1-8b --seq-len 131072 \
#       --batch-size 1 --mesh ulysses=2,context=32 --fsdp-axes ulysses,context --train \
#       --override compute_dtype=bfloat16 --chip v5p
#
#   train step: llama llama3.1-8b, batch 1 x seq 131072 on mesh ulysses=2,context=32 (weights split over fsdp axes ulysses,context); per device 1 x 2048 tokens; parameters float32, compute bfloat16; bytes per device
#   strategy    remat    params   grads    opt state  batch   activations  layer bwd  (attention)  logits   device    host     FLOPs/dev  time    (attn time)  MFU
#   all_gather  none     480 MiB  480 MiB  959 MiB    40 KiB  60.1 GiB     3.41 GiB   2.59 GiB     5.2 GiB  67.2 GiB  0 B      3.42e+14   1.08 s  877 ms       61.0%
#   all_gather  dots     480 MiB  480 MiB  959 MiB    40 KiB  5.25 GiB     5.2 GiB    2.59 GiB     5.2 GiB  12.3 GiB  0 B      4.12e+14   1.24 s  1.03 s       53.4%
#   all_gather  offload  480 MiB  480 MiB  959 MiB    40 KiB  1.25 MiB     5.2 GiB    2.59 GiB     5.2 GiB  7.08 GiB  512 MiB  4.44e+14   1.31 s  1.03 s       50.6%
#   all_gather  full     480 MiB  480 MiB  959 MiB    40 KiB  513 MiB      5.2 GiB    2.59 GiB     5.2 GiB  7.58 GiB  0 B      4.44e+14   1.31 s  1.03 s       50.6%
#   ring        none     480 MiB  480 MiB  959 MiB    40 KiB  44.3 GiB     1.04 GiB   233 MiB      5.2 GiB  51.4 GiB  0 B      3.42e+14   883 ms  677 ms       74.9%
#   ring        dots     480 MiB  480 MiB  959 MiB    40 KiB  5.25 GiB     2.83 GiB   233 MiB      5.2 GiB  12.3 GiB  0 B      4.12e+14   1.04 s  831 ms       63.7%
#   ring        offload  480 MiB  480 MiB  959 MiB    40 KiB  1.25 MiB     2.83 GiB   233 MiB      5.2 GiB  7.08 GiB  512 MiB  4.44e+14   1.11 s  831 ms       59.8%
#   ring        full     480 MiB  480 MiB  959 MiB    40 KiB  513 MiB      2.83 GiB   233 MiB      5.2 GiB  7.58 GiB  0 B      4.44e+14   1.11 s  831 ms       59.8%
#   usp         none     480 MiB  480 MiB  959 MiB    40 KiB  44.3 GiB     1.06 GiB   257 MiB      5.2 GiB  51.4 GiB  0 B      3.42e+14   758 ms  552 ms       87.2%
#   usp         dots     480 MiB  480 MiB  959 MiB    40 KiB  5.25 GiB     2.85 GiB   257 MiB      5.2 GiB  12.3 GiB  0 B      4.12e+14   912 ms  706 ms       72.5%
#   usp         offload  480 MiB  480 MiB  959 MiB    40 KiB  1.25 MiB     2.85 GiB   257 MiB      5.2 GiB  7.08 GiB  512 MiB  4.44e+14   980 ms  706 ms       67.4%
#   usp         full     480 MiB  480 MiB  959 MiB    40 KiB  513 MiB      2.85 GiB   257 MiB      5.2 GiB  7.58 GiB  0 B      4.44e+14   980 ms  706 ms       67.4%
#   device = params + grads + opt state + batch + activations + max(layer bwd, logits) (opt state only at the update when offloaded); host = offloaded activations and state
#   time = every layer's matmuls and attention (recomputation and exposed communication included) on the busiest device at 459 TFLOP/s and 100 GB/s per link (v5p); model FLOPs per step 1.94e+16 (6 x active params x tokens + causal attention + linear attention's chunked form, no recomputation); MFU = model FLOPs / (time x 64 devices x FLOP/s)
#   32 global layers: usp, 1.01 GiB per device per layer (forward + backward)
#   budget 95 GiB: chosen usp, remat='none' (the fastest predicted step that fits 95 GiB (51.4 GiB per device))
#
# Chosen: CHIPS=32 ring, remat none (71.6 GiB, 1.49 s per step); CHIPS=64 usp, remat none
# (51.4 GiB, 0.758 s). The budget is the whole HBM: leave a few GiB for XLA's runtime.
# tests/test_pod_recipes.py plans every slice in SLICES and compiles a tiny stand-in.

SLICES="v5p:32 v5p:64"  # SLICE:CHIPS pairs this recipe was planned for
case "${SLICE:-v5p}:${CHIPS:-64}" in
  v5p:32) ACCELERATOR=v5p-64 DEVICES=32 MESH=context=32 FSDP=context STRATEGY=ring ;;
  v5p:64) ACCELERATOR=v5p-128 DEVICES=64 MESH=ulysses=2,context=32 FSDP=ulysses,context \
    STRATEGY=usp ;;
  *) echo "SLICE=v5p with CHIPS=32 or 64; got SLICE=${SLICE:-v5p} CHIPS=${CHIPS:-64}" >&2
    return 2 2>/dev/null || exit 2 ;;
esac
FLAGS="--model llama --preset llama3.1-8b --seq-len 131072 --batch-size 1 \
  --devices $DEVICES --mesh $MESH --fsdp-axes $FSDP \
  --strategy $STRATEGY --load-balance zigzag --remat none --override compute_dtype=bfloat16 \
  --steps 200 --lr 3e-4 --warmup-steps 10 --max-bytes 100000000 \
  --eval-every 50 --eval-batches 1 --final-eval-batches 1 --checkpoint-every 50${DATA:+ --data $DATA}"

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  echo "on each of the $ACCELERATOR workers: python3 -m eqx_longctx.train $FLAGS --run-dir RUN_DIR"
fi
