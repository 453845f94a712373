#!/usr/bin/env bash
# The GPU checks, in one run (an H200 image with jax, flax, optax and orbax):
#   1. jaxroll's Pallas kernels compiled for the GPU against their references,
#      and timed against them (scripts/gpu_kernels.py, bfloat16);
#   2. the rollout benchmark at the Qwen2.5-0.5B shape in bfloat16, batch 64,
#      with its decode step's fraction of the HBM roofline (--peak-gbps);
#   3. a few training steps of configs/quick.py on the GPU.
# Packages the image lacks (grain, math-verify, tensorboardX and their
# needs) travel as wheels in .whl/ (git-ignored; fetched beforehand with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl`
# for the image's Python); they are installed into /tmp/site.
# Results go to $OUT (or bench_out/gpu) as JSON lines and logs.
#
#   bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench_out/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# jaxroll.kernels is the kernels/ folder (setup.py maps it); without an
# install, a link gives the same import path.
[ -e jaxroll/kernels ] || ln -s ../kernels jaxroll/kernels
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$out/devices.txt"
status=0

python3 scripts/gpu_kernels.py --dtype bfloat16 2>&1 | tee "$out/kernels.log" || status=1

ckpt=bench_out/qwen2-qwen2.5-0.5b
[ -f "$ckpt/config.json" ] || python3 -c "import sys; sys.path.insert(0, 'scripts'); \
import make_random_checkpoint as m; m.make('qwen2.5-0.5b', '$ckpt')" || status=1
# H200: 4.8 TB/s of HBM3e (datasheet).
python3 scripts/bench_rollout.py --hf-checkpoint "$ckpt" --batch 64 --prompt-len 32 \
  --new-tokens 128 --dtype bfloat16 --peak-gbps 4800 2>&1 | tee "$out/rollout.log" || status=1

python3 -m jaxroll.cli train configs/quick.py --set steps=4 --set eval_every=4 --set progress=false \
  --set run_dir=/tmp/gpu_run 2>&1 | tail -n 20 | tee "$out/train.log" || status=1
cp /tmp/gpu_run/timing.jsonl "$out/" 2>/dev/null
exit $status
