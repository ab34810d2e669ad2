#!/usr/bin/env bash
# Train on a Cloud TPU VM slice of several hosts: create the slice, install the repository on
# every worker, and start the same entry point as on a laptop on all of them at once.
#
#   examples/cloud_tpu.sh create      # make the slice (SLICE=v5p or v6e, see below)
#   examples/cloud_tpu.sh setup       # install JAX for TPU and this repository on every worker,
#                                     # then run the selftest there (below)
#   examples/cloud_tpu.sh selftest    # check the kernels, a ring and the chips on every worker
#   examples/cloud_tpu.sh train       # the main job on all workers (one process per host)
#   examples/cloud_tpu.sh delete      # delete the slice (it bills while it exists)
#
# With RECIPE=examples/recipes/<name>.sh every command uses that long-context recipe
# instead of the main job: `create` makes the slice size it was planned for, `train` runs
# its flags (model, sequence, mesh, strategy, remat; each recipe says why, quoting the
# planner). RESUME=1 with `train` continues the run from its newest checkpoint.
#
# One process runs per host. On a Cloud TPU slice the processes find each other from the TPU
# metadata (`jax.distributed.initialize()` with no arguments), so no --coordinator /
# --num-processes / --process-id flags are needed: every worker runs the identical command.
# `--devices` is the GLOBAL device count (every chip of the slice), `--mesh` is laid over all
# of them, and only process 0 (worker 0) prints, shows progress and writes metrics.jsonl /
# loss.png; checkpoints are written by all processes, each its own shards.
#
# The run directory must be ONE directory that every worker sees (checkpoints are written by
# all hosts, read back by all on --resume): a Filestore (NFS) share, or a Cloud Storage
# bucket mounted with gcsfuse at the same path on every worker (done in `setup` when BUCKET
# is set). A path on each worker's own disk would leave each host with a partial checkpoint.
#
# Failure: if a worker dies or hangs, the others exit with status 3 within --peer-timeout
# seconds (default 60) saying which process was lost; restart every worker with the same
# command plus --resume (see `train`).
set -euo pipefail

PROJECT=${PROJECT:-$(gcloud config get-value project 2>/dev/null)}
SLICE=${SLICE:-v5p}                 # v5p or v6e
TPU_NAME=${TPU_NAME:-eqx-longctx-$SLICE}
REPO_URL=${REPO_URL:-https://github.com/eqx-longctx/eqx_longctx.git}
BUCKET=${BUCKET:-}                  # e.g. my-bucket: mounted at /mnt/runs on every worker
RUN_ROOT=${RUN_ROOT:-/mnt/runs}     # shared by all workers (gcsfuse mount or NFS)
RECIPE=${RECIPE:-}
if [[ -n "$RECIPE" ]]; then
  # Sets ACCELERATOR, DEVICES and FLAGS for SLICE.
  # shellcheck disable=SC1090
  source "$RECIPE"
  name=$(basename "$RECIPE" .sh)
  TPU_NAME=${TPU_NAME_OVERRIDE:-eqx-longctx-${name//./-}-$SLICE}  # TPU names: [a-z0-9-]
fi

case "$SLICE" in
  v5p)
    # v5p-32: 16 chips on 4 hosts (4 chips each); each chip is one JAX device (its two
    # TensorCores act as one), so 16 devices in all. v5p-N has N/2 chips.
    ZONE=${ZONE:-us-east5-a}
    ACCELERATOR=${ACCELERATOR:-v5p-32}
    RUNTIME=${RUNTIME:-v2-alpha-tpuv5}
    DEVICES=${DEVICES:-16}
    ;;
  v6e)
    # v6e-16: 16 chips on 4 hosts (4 chips each), one JAX device per chip: 16 devices.
    # v6e-N has N chips.
    ZONE=${ZONE:-us-east5-b}
    ACCELERATOR=${ACCELERATOR:-v6e-16}
    RUNTIME=${RUNTIME:-v2-alpha-tpuv6e}
    DEVICES=${DEVICES:-16}
    ;;
  *)
    echo "SLICE must be v5p or v6e; got SLICE=$SLICE" >&2
    exit 2
    ;;
esac

# Every worker at once; `--worker=all` runs the command on each host of the slice over ssh.
on_all_workers() {
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" \
    --worker=all --command="$1"
}

create() {
  # v5p slice (16 chips, 4 hosts):
  #   gcloud compute tpus tpu-vm create eqx-longctx-v5p --zone=us-east5-a \
  #     --accelerator-type=v5p-32 --version=v2-alpha-tpuv5
  # v6e slice (16 chips, 4 hosts):
  #   gcloud compute tpus tpu-vm create eqx-longctx-v6e --zone=us-east5-b \
  #     --accelerator-type=v6e-16 --version=v2-alpha-tpuv6e
  # (add --spot for cheaper, preemptible capacity; quotas and zones: see the Cloud TPU docs;
  # the recipes need larger slices, e.g. --accelerator-type=v5p-128 for Llama 3.1 8B at 1M)
  gcloud compute tpus tpu-vm create "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" \
    --accelerator-type="$ACCELERATOR" --version="$RUNTIME"
}

setup() {
  local mount=""
  if [[ -n "$BUCKET" ]]; then
    # Cloud Storage FUSE (its documented apt install), then the bucket at RUN_ROOT.
    mount="(command -v gcsfuse >/dev/null || (
        echo 'deb https://packages.cloud.google.com/apt gcsfuse-'\$(lsb_release -cs)' main' |
          sudo tee /etc/apt/sources.list.d/gcsfuse.list &&
        curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo apt-key add - &&
        sudo apt-get update -q && sudo apt-get install -yq gcsfuse)) &&
      sudo mkdir -p $RUN_ROOT && sudo chown \$USER $RUN_ROOT &&
      (mountpoint -q $RUN_ROOT || gcsfuse --implicit-dirs $BUCKET $RUN_ROOT) && "
  fi
  on_all_workers "set -e; $mount
    python3 -m pip install -q -U pip &&
    (test -d eqx_longctx || git clone -q $REPO_URL eqx_longctx) &&
    cd eqx_longctx && git pull -q &&
    python3 -m pip install -q -e '.[tpu]' &&
    python3 -c 'import jax, eqx_longctx; print(\"jax\", jax.__version__)'"
  selftest
}

# Before the first job: `python -m eqx_longctx.selftest` on every worker at once (one
# program over the slice, like the job; each worker checks its own chips). It holds the
# Pallas kernels that impl="auto" runs on a TPU, compiled by Mosaic for this generation,
# against the XLA path and a float32 oracle (causal, window, packed, GQA; forward and
# backward) and a ring over the worker's chips, prints a table, and exits non-zero on any
# mismatch: then do not start the job; the table's first error line says where.
selftest() {
  on_all_workers "cd eqx_longctx && python3 -m eqx_longctx.selftest"
}

# The main job (the tiny Llama, 8 rows of 256 tokens), mesh over all 16 devices: the batch
# split in 2, each row's 256 tokens over 8 (the laptop default is data=2,context=4 on 8).
# Strategy and remat from the whole-step planner: at 32 tokens per chip, one all-to-all of
# the heads (Ulysses) beats ring's 8 key/value passes, and everything fits without remat:
#
#   python -m eqx_longctx.plan --model llama --preset tiny --seq 256 --batch 8 \
#       --mesh data=2,context=8 --train --memory-budget-gib 32
#   strategy    remat    params    grads     opt state  batch    activations  layer bwd  (attention)  logits   device    host     time
#   all_gather  none     11.6 MiB  11.6 MiB  23.2 MiB   2.5 KiB  17.3 MiB     4.02 MiB   4.02 MiB     324 KiB  67.6 MiB  0 B      0.0608 ms
#   ulysses     none     11.6 MiB  11.6 MiB  23.2 MiB   2.5 KiB  13.7 MiB     4.02 MiB   4.02 MiB     324 KiB  64.1 MiB  0 B      0.0425 ms
#   ring        none     11.6 MiB  11.6 MiB  23.2 MiB   2.5 KiB  13.7 MiB     1.89 MiB   1.89 MiB     324 KiB  61.9 MiB  0 B      0.0781 ms
#   budget 32 GiB: chosen ulysses, remat='none' (the fastest predicted step that fits 32 GiB (64.1 MiB per device))
#   (rows abridged; the same choice for 95 GiB)
if [[ -z "$RECIPE" ]]; then
  FLAGS="--devices $DEVICES --mesh data=2,context=$((DEVICES / 2)) --strategy ulysses \
    --remat none"
fi

train() {
  # --init-timeout: ssh starts the workers one after another, so allow for some skew.
  local run_dir="$RUN_ROOT/$(basename "${RECIPE:-main}" .sh)-$SLICE"
  on_all_workers "cd eqx_longctx && python3 -m eqx_longctx.train $FLAGS --init-timeout 600 \
    --no-progress --run-dir $run_dir ${RESUME:+--resume}"
}

delete() {
  gcloud compute tpus tpu-vm delete "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" --quiet
}

"${1:-train}" "${@:2}"
