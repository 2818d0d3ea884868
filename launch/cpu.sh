#!/usr/bin/env bash
# CPU runs (gloo backend), for smoke tests and the tiny recipes:
#   launch/cpu.sh recipes/tiny_stage1.yaml [key=value ...]             # NPROC ranks (default 2), DeepSpeed ZeRO-2
#   LAUNCHER=torchrun launch/cpu.sh recipes/tiny_stage1.yaml           # DDP instead of DeepSpeed
#   NPROC=1 LAUNCHER=python launch/cpu.sh recipes/tiny_stage1.yaml     # one process
# The first DeepSpeed run compiles a small op (~1 min, cached in ~/.cache/torch_extensions).
set -euo pipefail
recipe=${1:?usage: $0 RECIPE [key=value ...]}; shift
nproc=${NPROC:-2}
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / nproc > 0 ? $(nproc) / nproc : 1 ))}
acre-train validate "$recipe" "$@" --world-size "$nproc"
case "${LAUNCHER:-deepspeed}" in
  deepspeed) exec deepspeed --num_gpus "$nproc" --module acre_train.train "$recipe" \
               train.deepspeed="${DS_CONFIG:-recipes/deepspeed/zero2.json}" "$@" ;;
  torchrun)  exec torchrun --standalone --nproc_per_node "$nproc" -m acre_train.train "$recipe" "$@" ;;
  python)    exec python -m acre_train.train "$recipe" "$@" ;;
  *) echo "LAUNCHER must be deepspeed, torchrun or python" >&2; exit 2 ;;
esac
