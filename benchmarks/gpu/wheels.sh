#!/usr/bin/env bash
# The wheels the GPU image lacks (its package list: .library/device/KINDS.md), for Python
# 3.12 on x86-64, into .whl/ (ignored by git; `run.sh` installs them when it is carried):
# grain and its array-record and portpicker, and beartype. Everything else the library needs
# (JAX with CUDA, equinox, optax, orbax, einops, jaxtyping, tqdm, matplotlib, torch,
# transformers) is in the image.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 beartype==0.23.1
ls -l .whl
