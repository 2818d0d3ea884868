#!/usr/bin/env bash
# One node, all its GPUs, DeepSpeed launcher:
#   launch/single_node.sh recipes/qwen2.5-3b_stage1.yaml [key=value ...]
# NUM_GPUS=4 picks fewer GPUs; INCLUDE=localhost:0,1 picks which ones (the deepspeed launcher ignores
# CUDA_VISIBLE_DEVICES). Resume an interrupted run with checkpoint.resume_from_checkpoint=latest.
set -euo pipefail
recipe=${1:?usage: $0 RECIPE [key=value ...]}; shift
acre-train validate "$recipe" "$@" --world-size "${NUM_GPUS:-$(nvidia-smi -L | wc -l)}"
if [[ -n "${INCLUDE:-}" ]]; then
  exec deepspeed --include "$INCLUDE" --module acre_train.train "$recipe" "$@"
fi
exec deepspeed --num_gpus "${NUM_GPUS:-$(nvidia-smi -L | wc -l)}" --module acre_train.train "$recipe" "$@"
