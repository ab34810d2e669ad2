# Recipe: DeepSeek-V3 (the deepseek-v3 preset, byte vocabulary: 671B parameters, MLA, 256
# routed experts of which 8 per token) on sequences of 1M (1,048,576) tokens, two per step,
# on a v5p-1024 (CHIPS=512, the default) or v5p-512 (CHIPS=256) slice. v5p-256 (CHIPS=128)
# and v5p-128 (CHIPS=64) are refused: nothing fits them (below).
#
#   RECIPE=examples/recipes/deepseek-v3-1m.sh SLICE=v5p CHIPS=512 examples/cloud_tpu.sh create
#   RECIPE=examples/recipes/deepseek-v3-1m.sh SLICE=v5p CHIPS=512 examples/cloud_tpu.sh setup
#   RECIPE=examples/recipes/deepseek-v3-1m.sh SLICE=v5p CHIPS=512 examples/cloud_tpu.sh train
#   CHIPS=256 bash examples/recipes/deepseek-v3-1m.sh    # print the command every worker runs
#
# Same entry point as the laptop main job: `python -m eqx_longctx.train`, one process per
# host; --devices is the slice's chip count. DATA=FOLDER or DATA=hf:DATASET adds --data
# (default: the Python standard library, ~12 MB: about a dozen 1M-token rows, so this is a
# systems recipe).
#
# State: float32 weights, gradients and AdamW's two moments are 16 bytes per parameter,
# 161 GiB per chip on 64 chips before a single activation, so the weights go over
# every axis that can take them: --fsdp-axes context, the tensor axis (MLA's 128 heads and
# each expert's hidden units) and the expert axis (the routed experts).
# Mesh, CHIPS=512: expert=2,tensor=4,context=64. Expert parallelism splits the batch over
# its axis, so a step is --batch-size 2 sequences of 1M, each over 4 x 64 chips (16,384
# tokens per chip). Per chip: 5.05 GiB of weights, 5.05 of gradients, 10.1 of moments.
# One sequence per step (--batch-size 1, tensor=8,context=64) plans at 83.8 GiB and 55.1 s:
# the same tokens per second, with less room.
# Strategy: ring in a zig-zag layout. All-gather's layer backward holds every key and value
# (150 GiB); Ulysses cannot split the 32 heads a chip keeps (128 over tensor=4) over 64.
# Remat: `offload` (each layer's input in host memory, 13.3 GiB per chip; everything else
# recomputed), the fastest that fits: 75.1 GiB, 110 s per step, 65.4% MFU; `full` is as
# fast at 88.5 GiB, `dots` needs 141 GiB.
# Experts: --override capacity_factor=1.25 (each expert device takes at most 1.25 x its
# even share of token copies; the rest are dropped, as in MaxText); dropless dispatch plans
# at 84.4 GiB on 512 chips and does not fit 256 (96.2 GiB). --override grouped_matmul=ragged_dot is what
# "auto" picks on a TPU; it is named so that the planner, which traces on CPU (where "auto"
# is "scan"), prices the program the TPU runs.
# CHIPS=256 (v5p-512): expert=2,tensor=2,context=64 fits only with --host-offload opt_state
# (AdamW's moments, 20.1 GiB per chip, in host memory except during the update; 107 GiB
# without): ring, `offload`, 92.7 GiB (2.3 GiB under the budget), 220 s per step. Ulysses
# with `offload` leaves more room, 86.9 GiB, for 2 s more per step.
# CHIPS=128 (v5p-256) and 64 (v5p-128): nothing fits by the planner's count. The least is
# Ulysses with `offload`: 136 GiB on 128 chips (80.4 GiB of it weights, gradients and
# moments, one layer's backward 95.5 GiB) and 233 GiB on 64 (161 GiB of state). The other
# meshes planned on 128 chips (tensor=2 or 4 with --batch-size 1, expert=2 or 4) need 136 to
# 146 GiB. The recipe refuses them (exit 2).
#
# The planner, for exactly these runs (the preset's 129,280-token vocabulary: the planner's
# CLI has no byte tokenizer, so its output head and logits are larger than the run's 259
# tokens: an upper bound), on 512 chips:
#
#   python -m eqx_longctx.plan --model deepseek --preset deepseek-v3 --seq-len 1048576 \
#       --batch-size 2 --mesh expert=2,tensor=4,context=64 --fsdp-axes context --train \
#       --override compute_dtype=bfloat16 --override grouped_matmul=ragged_dot \
#       --override capacity_factor=1.25 --chip v5p
#
#   train step: deepseek deepseek-v3, batch 2 x seq 1048576 on mesh expert=2,tensor=4,context=64 (weights split over fsdp axes context); per device 1 x 16384 tokens; parameters float32, compute bfloat16; bytes per device
#   strategy    remat    params    grads     opt state  batch    activations  layer bwd  (attention)  logits    device    host      FLOPs/dev  time    (attn time)  MFU
#   all_gather  none     5.05 GiB  5.05 GiB  10.1 GiB   320 KiB  3115 GiB     107 GiB    101 GiB      2.47 GiB  3241 GiB  0 B       3.96e+16   112 s   110 s        64.4%
#   all_gather  dots     5.05 GiB  5.05 GiB  10.1 GiB   320 KiB  65.9 GiB     150 GiB    101 GiB      2.47 GiB  237 GiB   0 B       5.03e+16   135 s   133 s        53.3%
#   all_gather  offload  5.05 GiB  5.05 GiB  10.1 GiB   320 KiB  11.8 MiB     150 GiB    101 GiB      2.47 GiB  171 GiB   13.3 GiB  5.06e+16   136 s   133 s        53.0%
#   all_gather  full     5.05 GiB  5.05 GiB  10.1 GiB   320 KiB  13.4 GiB     150 GiB    101 GiB      2.47 GiB  184 GiB   0 B       5.06e+16   136 s   133 s        53.0%
#   ring        none     5.05 GiB  5.05 GiB  10.1 GiB   320 KiB  1913 GiB     11 GiB     5.5 GiB      2.47 GiB  1944 GiB  0 B       3.96e+16   86.2 s  84.2 s       83.7%
#   ring        dots     5.05 GiB  5.05 GiB  10.1 GiB   320 KiB  65.9 GiB     54.9 GiB   5.5 GiB      2.47 GiB  141 GiB   0 B       5.03e+16   110 s   108 s        65.8%
#   ring        offload  5.05 GiB  5.05 GiB  10.1 GiB   320 KiB  11.8 MiB     54.9 GiB   5.5 GiB      2.47 GiB  75.1 GiB  13.3 GiB  5.06e+16   110 s   108 s        65.4%
#   ring        full     5.05 GiB  5.05 GiB  10.1 GiB   320 KiB  13.4 GiB     54.9 GiB   5.5 GiB      2.47 GiB  88.5 GiB  0 B       5.06e+16   110 s   108 s        65.4%
#   device = params + grads + opt state + batch + activations + max(layer bwd, logits) (opt state only at the update when offloaded); host = offloaded activations and state
#   time = every layer's matmuls and attention (recomputation and exposed communication included) on the busiest device at 459 TFLOP/s and 100 GB/s per link (v5p); model FLOPs per step 1.69e+19 (6 x active params x tokens + causal attention + linear attention's chunked form, no recomputation); MFU = model FLOPs / (time x 512 devices x FLOP/s)
#   61 global layers: ring, 78.8 GiB per device per layer (forward + backward)
#   budget 95 GiB: chosen ring, remat='offload' (the fastest predicted step that fits 95 GiB (75.1 GiB per device))
#
# on 256 chips (--mesh expert=2,tensor=2,context=64 --host-offload opt_state):
#
#   train step: deepseek deepseek-v3, batch 2 x seq 1048576 on mesh expert=2,tensor=2,context=64 (weights split over fsdp axes context); per device 1 x 16384 tokens; parameters float32, compute bfloat16; bytes per device
#   strategy    remat    params  grads   opt state  batch    activations  layer bwd  (attention)  logits    device    host      FLOPs/dev  time   (attn time)  MFU
#   all_gather  none     10 GiB  10 GiB  20.1 GiB   320 KiB  4528 GiB     213 GiB    202 GiB      4.63 GiB  4761 GiB  20.1 GiB  7.91e+16   224 s  220 s        64.4%
#   all_gather  dots     10 GiB  10 GiB  20.1 GiB   320 KiB  93.4 GiB     264 GiB    202 GiB      4.63 GiB  377 GiB   20.1 GiB  1.01e+17   271 s  267 s        53.3%
#   all_gather  offload  10 GiB  10 GiB  20.1 GiB   320 KiB  11.8 MiB     264 GiB    202 GiB      4.63 GiB  284 GiB   33.4 GiB  1.01e+17   272 s  267 s        53.0%
#   all_gather  full     10 GiB  10 GiB  20.1 GiB   320 KiB  13.4 GiB     264 GiB    202 GiB      4.63 GiB  297 GiB   20.1 GiB  1.01e+17   272 s  267 s        53.0%
#   ulysses     none     10 GiB  10 GiB  20.1 GiB   320 KiB  2126 GiB     16.2 GiB   5.26 GiB     4.63 GiB  2162 GiB  20.1 GiB  7.91e+16   174 s  170 s        82.9%
#   ulysses     dots     10 GiB  10 GiB  20.1 GiB   320 KiB  93.4 GiB     66.8 GiB   5.26 GiB     4.63 GiB  180 GiB   20.1 GiB  1.01e+17   221 s  217 s        65.3%
#   ulysses     offload  10 GiB  10 GiB  20.1 GiB   320 KiB  11.8 MiB     66.8 GiB   5.26 GiB     4.63 GiB  86.9 GiB  33.4 GiB  1.01e+17   222 s  217 s        64.9%
#   ulysses     full     10 GiB  10 GiB  20.1 GiB   320 KiB  13.4 GiB     66.8 GiB   5.26 GiB     4.63 GiB  100 GiB   20.1 GiB  1.01e+17   222 s  217 s        64.9%
#   ring        none     10 GiB  10 GiB  20.1 GiB   320 KiB  2126 GiB     22 GiB     11 GiB       4.63 GiB  2168 GiB  20.1 GiB  7.91e+16   172 s  168 s        83.7%
#   ring        dots     10 GiB  10 GiB  20.1 GiB   320 KiB  93.4 GiB     72.6 GiB   11 GiB       4.63 GiB  186 GiB   20.1 GiB  1.01e+17   219 s  215 s        65.8%
#   ring        offload  10 GiB  10 GiB  20.1 GiB   320 KiB  11.8 MiB     72.6 GiB   11 GiB       4.63 GiB  92.7 GiB  33.4 GiB  1.01e+17   220 s  215 s        65.4%
#   ring        full     10 GiB  10 GiB  20.1 GiB   320 KiB  13.4 GiB     72.6 GiB   11 GiB       4.63 GiB  106 GiB   20.1 GiB  1.01e+17   220 s  215 s        65.4%
#   device = params + grads + opt state + batch + activations + max(layer bwd, logits) (opt state only at the update when offloaded); host = offloaded activations and state
#   time = every layer's matmuls and attention (recomputation and exposed communication included) on the busiest device at 459 TFLOP/s and 100 GB/s per link (v5p); model FLOPs per step 1.69e+19 (6 x active params x tokens + causal attention + linear attention's chunked form, no recomputation); MFU = model FLOPs / (time x 256 devices x FLOP/s)
#   61 global layers: ring, 158 GiB per device per layer (forward + backward)
#   budget 95 GiB: chosen ring, remat='offload' (the fastest predicted step that fits 95 GiB (92.7 GiB per device))
#
# on 128 chips (--mesh expert=2,tensor=2,context=32 --host-offload opt_state), where it exits
# with status 2:
#
#   train step: deepseek deepseek-v3, batch 2 x seq 1048576 on mesh expert=2,tensor=2,context=32 (weights split over fsdp axes context); per device 1 x 32768 tokens; parameters float32, compute bfloat16; bytes per device
#   strategy    remat    params    grads     opt state  batch    activations  layer bwd  (attention)  logits    device    host      FLOPs/dev  time   (attn time)  MFU
#   all_gather  none     20.1 GiB  20.1 GiB  40.2 GiB   640 KiB  5670 GiB     215 GiB    204 GiB      4.63 GiB  5925 GiB  40.2 GiB  1.58e+17   396 s  388 s        72.9%
#   all_gather  dots     20.1 GiB  20.1 GiB  40.2 GiB   640 KiB  187 GiB      289 GiB    204 GiB      4.63 GiB  516 GiB   40.2 GiB  2.01e+17   489 s  481 s        59.0%
#   all_gather  offload  20.1 GiB  20.1 GiB  40.2 GiB   640 KiB  23.6 MiB     289 GiB    204 GiB      4.63 GiB  329 GiB   66.9 GiB  2.02e+17   492 s  481 s        58.7%
#   all_gather  full     20.1 GiB  20.1 GiB  40.2 GiB   640 KiB  26.7 GiB     289 GiB    204 GiB      4.63 GiB  356 GiB   40.2 GiB  2.02e+17   492 s  481 s        58.7%
#   ulysses     none     20.1 GiB  20.1 GiB  40.2 GiB   640 KiB  3306 GiB     21.5 GiB   10.5 GiB     4.63 GiB  3368 GiB  40.2 GiB  1.58e+17   348 s  340 s        82.9%
#   ulysses     dots     20.1 GiB  20.1 GiB  40.2 GiB   640 KiB  187 GiB      95.5 GiB   10.5 GiB     4.63 GiB  322 GiB   40.2 GiB  2.01e+17   441 s  434 s        65.3%
#   ulysses     offload  20.1 GiB  20.1 GiB  40.2 GiB   640 KiB  23.6 MiB     95.5 GiB   10.5 GiB     4.63 GiB  136 GiB   66.9 GiB  2.02e+17   444 s  434 s        64.9%
#   ulysses     full     20.1 GiB  20.1 GiB  40.2 GiB   640 KiB  26.7 GiB     95.5 GiB   10.5 GiB     4.63 GiB  162 GiB   40.2 GiB  2.02e+17   444 s  434 s        64.9%
#   ring        none     20.1 GiB  20.1 GiB  40.2 GiB   640 KiB  3306 GiB     33 GiB     22 GiB       4.63 GiB  3379 GiB  40.2 GiB  1.58e+17   345 s  337 s        83.7%
#   ring        dots     20.1 GiB  20.1 GiB  40.2 GiB   640 KiB  187 GiB      107 GiB    22 GiB       4.63 GiB  334 GiB   40.2 GiB  2.01e+17   438 s  430 s        65.8%
#   ring        offload  20.1 GiB  20.1 GiB  40.2 GiB   640 KiB  23.6 MiB     107 GiB    22 GiB       4.63 GiB  147 GiB   66.9 GiB  2.02e+17   441 s  430 s        65.4%
#   ring        full     20.1 GiB  20.1 GiB  40.2 GiB   640 KiB  26.7 GiB     107 GiB    22 GiB       4.63 GiB  174 GiB   40.2 GiB  2.02e+17   441 s  430 s        65.4%
#   device = params + grads + opt state + batch + activations + max(layer bwd, logits) (opt state only at the update when offloaded); host = offloaded activations and state
#   time = every layer's matmuls and attention (recomputation and exposed communication included) on the busiest device at 459 TFLOP/s and 100 GB/s per link (v5p); model FLOPs per step 1.69e+19 (6 x active params x tokens + causal attention + linear attention's chunked form, no recomputation); MFU = model FLOPs / (time x 128 devices x FLOP/s)
#   61 global layers: all_gather, 77.5 GiB per device per layer (forward + backward)
#   budget 95 GiB: nothing fits (nothing fits 95 GiB per device; the least is ulysses with remat='offload' at 136 GiB (largest part: layer_backward 95.5 GiB), which fits a budget of 136 GiB. To fit 95 GiB, spread the tokens over more devices (a larger context axis, or a smaller batch: activations and logits scale with the tokens per device), or the weights over more axes (--fsdp-axes, tensor=, expert=))
#   python -m eqx_longctx.plan: error: nothing fits 95 GiB per device; the least is ulysses with remat='offload' at 136 GiB (largest part: layer_backward 95.5 GiB), which fits a budget of 136 GiB. To fit 95 GiB, spread the tokens over more devices (a larger context axis, or a smaller batch: activations and logits scale with the tokens per device), or the weights over more axes (--fsdp-axes, tensor=, expert=)
#
# and on 64 chips (--mesh expert=2,tensor=2,context=16 --host-offload opt_state), status 2:
#
#   train step: deepseek deepseek-v3, batch 2 x seq 1048576 on mesh expert=2,tensor=2,context=16 (weights split over fsdp axes context); per device 1 x 65536 tokens; parameters float32, compute bfloat16; bytes per device
#   strategy    remat    params    grads     opt state  batch     activations  layer bwd  (attention)  logits    device    host      FLOPs/dev  time   (attn time)  MFU
#   all_gather  none     40.2 GiB  40.2 GiB  80.3 GiB   1.25 MiB  7954 GiB     219 GiB    209 GiB      4.63 GiB  8254 GiB  80.3 GiB  3.16e+17   739 s  723 s        78.1%
#   all_gather  dots     40.2 GiB  40.2 GiB  80.3 GiB   1.25 MiB  374 GiB      340 GiB    209 GiB      4.63 GiB  794 GiB   80.3 GiB  4.02e+17   926 s  910 s        62.3%
#   all_gather  offload  40.2 GiB  40.2 GiB  80.3 GiB   1.25 MiB  47.2 MiB     340 GiB    209 GiB      4.63 GiB  421 GiB   134 GiB   4.05e+17   931 s  910 s        62.0%
#   all_gather  full     40.2 GiB  40.2 GiB  80.3 GiB   1.25 MiB  53.4 GiB     340 GiB    209 GiB      4.63 GiB  474 GiB   80.3 GiB  4.05e+17   931 s  910 s        62.0%
#   ulysses     none     40.2 GiB  40.2 GiB  80.3 GiB   1.25 MiB  5666 GiB     32 GiB     21 GiB       4.63 GiB  5778 GiB  80.3 GiB  3.16e+17   696 s  680 s        82.9%
#   ulysses     dots     40.2 GiB  40.2 GiB  80.3 GiB   1.25 MiB  374 GiB      153 GiB    21 GiB       4.63 GiB  607 GiB   80.3 GiB  4.02e+17   883 s  867 s        65.3%
#   ulysses     offload  40.2 GiB  40.2 GiB  80.3 GiB   1.25 MiB  47.2 MiB     153 GiB    21 GiB       4.63 GiB  233 GiB   134 GiB   4.05e+17   888 s  867 s        65.0%
#   ulysses     full     40.2 GiB  40.2 GiB  80.3 GiB   1.25 MiB  53.4 GiB     153 GiB    21 GiB       4.63 GiB  287 GiB   80.3 GiB  4.05e+17   888 s  867 s        65.0%
#   ring        none     40.2 GiB  40.2 GiB  80.3 GiB   1.25 MiB  5666 GiB     55 GiB     44 GiB       4.63 GiB  5801 GiB  80.3 GiB  3.16e+17   689 s  674 s        83.7%
#   ring        dots     40.2 GiB  40.2 GiB  80.3 GiB   1.25 MiB  374 GiB      176 GiB    44 GiB       4.63 GiB  630 GiB   80.3 GiB  4.02e+17   877 s  861 s        65.8%
#   ring        offload  40.2 GiB  40.2 GiB  80.3 GiB   1.25 MiB  47.2 MiB     176 GiB    44 GiB       4.63 GiB  256 GiB   134 GiB   4.05e+17   882 s  861 s        65.4%
#   ring        full     40.2 GiB  40.2 GiB  80.3 GiB   1.25 MiB  53.4 GiB     176 GiB    44 GiB       4.63 GiB  310 GiB   80.3 GiB  4.05e+17   882 s  861 s        65.4%
#   device = params + grads + opt state + batch + activations + max(layer bwd, logits) (opt state only at the update when offloaded); host = offloaded activations and state
#   time = every layer's matmuls and attention (recomputation and exposed communication included) on the busiest device at 459 TFLOP/s and 100 GB/s per link (v5p); model FLOPs per step 1.69e+19 (6 x active params x tokens + causal attention + linear attention's chunked form, no recomputation); MFU = model FLOPs / (time x 64 devices x FLOP/s)
#   61 global layers: all_gather, 75 GiB per device per layer (forward + backward)
#   budget 95 GiB: nothing fits (nothing fits 95 GiB per device; the least is ulysses with remat='offload' at 233 GiB (largest part: layer_backward 153 GiB), which fits a budget of 233 GiB. To fit 95 GiB, spread the tokens over more devices (a larger context axis, or a smaller batch: activations and logits scale with the tokens per device), or the weights over more axes (--fsdp-axes, tensor=, expert=))
#   python -m eqx_longctx.plan: error: nothing fits 95 GiB per device; the least is ulysses with remat='offload' at 233 GiB (largest part: layer_backward 153 GiB), which fits a budget of 233 GiB. To fit 95 GiB, spread the tokens over more devices (a larger context axis, or a smaller batch: activations and logits scale with the tokens per device), or the weights over more axes (--fsdp-axes, tensor=, expert=)
#
# Chosen: CHIPS=512 ring, remat offload (75.1 GiB + 13.3 GiB host, 110 s per step);
# CHIPS=256 ring, remat offload, --host-offload opt_state (92.7 GiB + 33.4 GiB host, 220 s);
# CHIPS=128 and 64 refused. The budget is the whole HBM: leave a few GiB for XLA's runtime.
# tests/test_pod_recipes.py plans every slice in SLICES.

SLICES="v5p:64 v5p:128 v5p:256 v5p:512"  # SLICE:CHIPS pairs planned (64 and 128 refused)
LEAST="" OFFLOAD=""
case "${SLICE:-v5p}:${CHIPS:-512}" in
  v5p:64) ACCELERATOR=v5p-128 DEVICES=64 TENSOR=2 OFFLOAD=opt_state LEAST=233 ;;
  v5p:128) ACCELERATOR=v5p-256 DEVICES=128 TENSOR=2 OFFLOAD=opt_state LEAST=136 ;;
  v5p:256) ACCELERATOR=v5p-512 DEVICES=256 TENSOR=2 OFFLOAD=opt_state ;;  # 256 chips
  v5p:512) ACCELERATOR=v5p-1024 DEVICES=512 TENSOR=4 ;;                  # 512 chips
  *) echo "SLICE=v5p with CHIPS=256 or 512; got SLICE=${SLICE:-v5p} CHIPS=${CHIPS:-512}" >&2
    return 2 2>/dev/null || exit 2 ;;
esac
FLAGS="--model deepseek --preset deepseek-v3 --seq-len 1048576 --batch-size 2 \
  --devices $DEVICES --mesh expert=2,tensor=$TENSOR,context=$((DEVICES / 2 / TENSOR)) \
  --fsdp-axes context --strategy ring --load-balance zigzag --remat offload \
  ${OFFLOAD:+--host-offload $OFFLOAD }--override compute_dtype=bfloat16 \
  --override grouped_matmul=ragged_dot --override capacity_factor=1.25 \
  --steps 100 --lr 3e-4 --warmup-steps 10 --max-bytes 100000000 \
  --eval-every 50 --eval-batches 1 --final-eval-batches 1 --checkpoint-every 50${DATA:+ --data $DATA}"
if [[ -n "$LEAST" ]]; then
  echo "DeepSeek-V3 at 1M tokens does not fit $DEVICES v5p chips by the planner's count: the" \
    "least is ulysses with remat offload at $LEAST GiB per chip against 95 GiB. Use CHIPS=256" \
    "(v5p-512) or CHIPS=512 (v5p-1024)." >&2
  return 2 2>/dev/null || exit 2
fi

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  echo "on each of the $ACCELERATOR workers: python3 -m eqx_longctx.train $FLAGS --run-dir RUN_DIR"
fi
