# Recipe: Llama 3.1 8B (the llama3.1-8b preset, byte vocabulary) on one sequence of 14M
# (14,680,064 = 14 x 2^20) tokens, on a v5p-128 slice (CHIPS=64, the default). A v5p-64
# (CHIPS=32) is refused: nothing fits it (below).
#
#   RECIPE=examples/recipes/llama3.1-8b-14m.sh SLICE=v5p CHIPS=64 examples/cloud_tpu.sh create
#   RECIPE=examples/recipes/llama3.1-8b-14m.sh SLICE=v5p CHIPS=64 examples/cloud_tpu.sh setup
#   RECIPE=examples/recipes/llama3.1-8b-14m.sh SLICE=v5p CHIPS=64 examples/cloud_tpu.sh train
#   bash examples/recipes/llama3.1-8b-14m.sh      # print the command every worker runs
#
# Same entry point as the laptop main job: `python -m eqx_longctx.train`, one process per
# host; --devices is the slice's chip count. DATA=FOLDER or DATA=hf:DATASET adds --data
# (default: the Python standard library, ~12 MB: less than one 14M-token row, padded, so
# this is a systems recipe). A step takes hours, hence 10 steps and a checkpoint after each.
#
# Mesh: context=64 with the weights, gradients and AdamW state split over it (--fsdp-axes
# context, ZeRO-3): 229,376 tokens per chip.
# Strategy: ring in a zig-zag layout; all-gather's layer backward holds every key and value
# (357 GiB per chip), and Ulysses is capped at the 8 key-value heads.
# Remat: `offload`, the only policy that fits: each layer's input goes to host memory
# (with the moments below, 56.9 GiB per chip: 228 GiB on each 4-chip host; check the hosts'
# RAM) and everything else is recomputed. `full` needs 149 GiB per chip, `dots` 681 GiB. What is left on the chip is one
# layer's backward, 91.6 GiB (its recomputed activations and the ring's attention): 92.7 GiB
# in all, 2.3 GiB under the 95 GiB budget for XLA's own buffers.
# Host offload: --host-offload opt_state keeps AdamW's moments (959 MiB per chip) in host
# memory except during the update; without it the step needs 93.6 GiB (the same time).
# Time: 8.68e3 s (2.4 h) per step at the v5p's peak, 66.7% MFU by the planner's count.
# CHIPS=32 (v5p-64) does not fit: 458,752 tokens per chip make one layer's backward 181 GiB
# under every policy that recomputes, so the least is ring with `offload` at 183 GiB (185
# without --host-offload). Neither --host-offload opt_state,params nor a Ulysses x ring or
# tensor mesh brings it under 95 GiB (planned: 183, 185 and 227 GiB); the recipe refuses
# that slice (exit 2).
#
# The planner, for exactly these runs (the preset's 128,256-token vocabulary: the planner's
# CLI has no byte tokenizer, so its output head and logits are larger than the run's 259
# tokens: an upper bound), on 64 chips:
#
#   python -m eqx_longctx.plan --model llama --preset llama3.1-8b --seq-len 14680064 \
#       --batch-size 1 --mesh context=64 --fsdp-axes context --train \
#       --override compute_dtype=bfloat16 --host-offload opt_state --chip v5p
#
#   train step: llama llama3.1-8b, batch 1 x seq 14680064 on mesh context=64 (weights split over fsdp axes context); per device 1 x 229376 tokens; parameters float32, compute bfloat16; bytes per device
#   strategy    remat    params   grads    opt state  batch     activations  layer bwd  (attention)  logits   device    host      FLOPs/dev  time        (attn time)  MFU
#   all_gather  none     480 MiB  480 MiB  959 MiB    4.38 MiB  3846 GiB     291 GiB    291 GiB      5.2 GiB  4138 GiB  959 MiB   3.1e+18    6.79e+03 s  6.77e+03 s   85.3%
#   all_gather  dots     480 MiB  480 MiB  959 MiB    4.38 MiB  588 GiB      357 GiB    291 GiB      5.2 GiB  946 GiB   959 MiB   3.98e+18   8.72e+03 s  8.69e+03 s   66.5%
#   all_gather  offload  480 MiB  480 MiB  959 MiB    4.38 MiB  140 MiB      357 GiB    291 GiB      5.2 GiB  358 GiB   56.9 GiB  3.99e+18   8.72e+03 s  8.69e+03 s   66.4%
#   all_gather  full     480 MiB  480 MiB  959 MiB    4.38 MiB  56.1 GiB     357 GiB    291 GiB      5.2 GiB  414 GiB   959 MiB   3.99e+18   8.72e+03 s  8.69e+03 s   66.4%
#   ring        none     480 MiB  480 MiB  959 MiB    4.38 MiB  2078 GiB     26.2 GiB   25.4 GiB     5.2 GiB  2105 GiB  959 MiB   3.1e+18    6.75e+03 s  6.73e+03 s   85.8%
#   ring        dots     480 MiB  480 MiB  959 MiB    4.38 MiB  588 GiB      91.6 GiB   25.4 GiB     5.2 GiB  681 GiB   959 MiB   3.98e+18   8.68e+03 s  8.65e+03 s   66.7%
#   ring        offload  480 MiB  480 MiB  959 MiB    4.38 MiB  140 MiB      91.6 GiB   25.4 GiB     5.2 GiB  92.7 GiB  56.9 GiB  3.99e+18   8.68e+03 s  8.65e+03 s   66.7%
#   ring        full     480 MiB  480 MiB  959 MiB    4.38 MiB  56.1 GiB     91.6 GiB   25.4 GiB     5.2 GiB  149 GiB   959 MiB   3.99e+18   8.68e+03 s  8.65e+03 s   66.7%
#   device = params + grads + opt state + batch + activations + max(layer bwd, logits) (opt state only at the update when offloaded); host = offloaded activations and state
#   time = every layer's matmuls and attention (recomputation and exposed communication included) on the busiest device at 459 TFLOP/s and 100 GB/s per link (v5p); model FLOPs per step 1.7e+20 (6 x active params x tokens + causal attention + linear attention's chunked form, no recomputation); MFU = model FLOPs / (time x 64 devices x FLOP/s)
#   32 global layers: ring, 221 GiB per device per layer (forward + backward)
#   budget 95 GiB: chosen ring, remat='offload' (the fastest predicted step that fits 95 GiB (92.7 GiB per device))
#
# and on 32 chips (--mesh context=32), where it exits with status 2:
#
#   train step: llama llama3.1-8b, batch 1 x seq 14680064 on mesh context=32 (weights split over fsdp axes context); per device 1 x 458752 tokens; parameters float32, compute bfloat16; bytes per device
#   strategy    remat    params   grads    opt state  batch     activations  layer bwd  (attention)  logits   device    host      FLOPs/dev  time        (attn time)  MFU
#   all_gather  none     958 MiB  958 MiB  1.87 GiB   8.75 MiB  5870 GiB     302 GiB    301 GiB      5.2 GiB  6174 GiB  1.87 GiB  6.2e+18    1.35e+04 s  1.35e+04 s   85.5%
#   all_gather  dots     958 MiB  958 MiB  1.87 GiB   8.75 MiB  1176 GiB     431 GiB    301 GiB      5.2 GiB  1610 GiB  1.87 GiB  7.97e+18   1.74e+04 s  1.73e+04 s   66.6%
#   all_gather  offload  958 MiB  958 MiB  1.87 GiB   8.75 MiB  280 MiB      431 GiB    301 GiB      5.2 GiB  434 GiB   114 GiB   7.97e+18   1.74e+04 s  1.73e+04 s   66.5%
#   all_gather  full     958 MiB  958 MiB  1.87 GiB   8.75 MiB  112 GiB      431 GiB    301 GiB      5.2 GiB  546 GiB   1.87 GiB  7.97e+18   1.74e+04 s  1.73e+04 s   66.5%
#   ulysses     none     958 MiB  958 MiB  1.87 GiB   8.75 MiB  4130 GiB     56.9 GiB   56.1 GiB     5.2 GiB  4189 GiB  1.87 GiB  6.2e+18    1.35e+04 s  1.35e+04 s   85.7%
#   ulysses     dots     958 MiB  958 MiB  1.87 GiB   8.75 MiB  1176 GiB     186 GiB    56.1 GiB     5.2 GiB  1365 GiB  1.87 GiB  7.97e+18   1.74e+04 s  1.73e+04 s   66.7%
#   ulysses     offload  958 MiB  958 MiB  1.87 GiB   8.75 MiB  280 MiB      186 GiB    56.1 GiB     5.2 GiB  189 GiB   114 GiB   7.97e+18   1.74e+04 s  1.73e+04 s   66.7%
#   ulysses     full     958 MiB  958 MiB  1.87 GiB   8.75 MiB  112 GiB      186 GiB    56.1 GiB     5.2 GiB  301 GiB   1.87 GiB  7.97e+18   1.74e+04 s  1.73e+04 s   66.7%
#   ring        none     958 MiB  958 MiB  1.87 GiB   8.75 MiB  4130 GiB     51.7 GiB   50.9 GiB     5.2 GiB  4184 GiB  1.87 GiB  6.2e+18    1.35e+04 s  1.35e+04 s   85.8%
#   ring        dots     958 MiB  958 MiB  1.87 GiB   8.75 MiB  1176 GiB     181 GiB    50.9 GiB     5.2 GiB  1359 GiB  1.87 GiB  7.97e+18   1.74e+04 s  1.73e+04 s   66.7%
#   ring        offload  958 MiB  958 MiB  1.87 GiB   8.75 MiB  280 MiB      181 GiB    50.9 GiB     5.2 GiB  183 GiB   114 GiB   7.97e+18   1.74e+04 s  1.73e+04 s   66.7%
#   ring        full     958 MiB  958 MiB  1.87 GiB   8.75 MiB  112 GiB      181 GiB    50.9 GiB     5.2 GiB  295 GiB   1.87 GiB  7.97e+18   1.74e+04 s  1.73e+04 s   66.7%
#   device = params + grads + opt state + batch + activations + max(layer bwd, logits) (opt state only at the update when offloaded); host = offloaded activations and state
#   time = every layer's matmuls and attention (recomputation and exposed communication included) on the busiest device at 459 TFLOP/s and 100 GB/s per link (v5p); model FLOPs per step 1.7e+20 (6 x active params x tokens + causal attention + linear attention's chunked form, no recomputation); MFU = model FLOPs / (time x 32 devices x FLOP/s)
#   32 global layers: all_gather, 109 GiB per device per layer (forward + backward)
#   budget 95 GiB: nothing fits (nothing fits 95 GiB per device; the least is ring with remat='offload' at 183 GiB (largest part: layer_backward 181 GiB), which fits a budget of 183 GiB. To fit 95 GiB, spread the tokens over more devices (a larger context axis, or a smaller batch: activations and logits scale with the tokens per device), or the weights over more axes (--fsdp-axes, tensor=, expert=))
#   python -m eqx_longctx.plan: error: nothing fits 95 GiB per device; the least is ring with remat='offload' at 183 GiB (largest part: layer_backward 181 GiB), which fits a budget of 183 GiB. To fit 95 GiB, spread the tokens over more devices (a larger context axis, or a smaller batch: activations and logits scale with the tokens per device), or the weights over more axes (--fsdp-axes, tensor=, expert=)
#
# Chosen: CHIPS=64 ring, remat offload, --host-offload opt_state (92.7 GiB + 56.9 GiB host,
# 8.68e3 s per step); CHIPS=32 refused. tests/test_pod_recipes.py plans every slice in
# SLICES, and checks that the planner finds nothing for the refused one.

SLICES="v5p:32 v5p:64"  # SLICE:CHIPS pairs this recipe was planned for (CHIPS=32 refused)
REFUSE=""
case "${SLICE:-v5p}:${CHIPS:-64}" in
  v5p:32) ACCELERATOR=v5p-64 DEVICES=32
    REFUSE="Llama 3.1 8B at 14M tokens does not fit 32 v5p chips by the planner's count: the \
least is ring with remat offload at 183 GiB per chip (one layer's backward 181 GiB) against \
95 GiB. Use CHIPS=64 (a v5p-128 slice)." ;;
  v5p:64) ACCELERATOR=v5p-128 DEVICES=64 ;;  # 64 chips, 95 GiB each
  *) echo "SLICE=v5p with CHIPS=64; got SLICE=${SLICE:-v5p} CHIPS=${CHIPS:-64}" >&2
    return 2 2>/dev/null || exit 2 ;;
esac
FLAGS="--model llama --preset llama3.1-8b --seq-len 14680064 --batch-size 1 \
  --devices $DEVICES --mesh context=$DEVICES --fsdp-axes context \
  --strategy ring --load-balance zigzag --remat offload --host-offload opt_state \
  --override compute_dtype=bfloat16 \
  --steps 10 --lr 3e-4 --warmup-steps 2 --max-bytes 100000000 \
  --eval-every 5 --eval-batches 1 --final-eval-batches 1 --checkpoint-every 1${DATA:+ --data $DATA}"
if [[ -n "$REFUSE" ]]; then
  echo "$REFUSE" >&2
  return 2 2>/dev/null || exit 2
fi

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  echo "on each of the $ACCELERATOR workers: python3 -m eqx_longctx.train $FLAGS --run-dir RUN_DIR"
fi
