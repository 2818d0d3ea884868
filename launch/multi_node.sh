#!/usr/bin/env bash
# Several nodes with the DeepSpeed launcher (passwordless ssh to every host; same paths everywhere;
# output_root on a shared filesystem so every rank writes into the same checkpoint directory):
#   launch/multi_node.sh hostfile recipes/qwen2.5-7b_stage1.yaml [key=value ...]
# hostfile lines look like "node1 slots=8". MASTER_ADDR defaults to the first host.
set -euo pipefail
hostfile=${1:?usage: $0 HOSTFILE RECIPE [key=value ...]}; recipe=${2:?usage: $0 HOSTFILE RECIPE [key=value ...]}; shift 2
master=${MASTER_ADDR:-$(grep -v '^\s*#' "$hostfile" | awk 'NF{print $1; exit}')}
world=$(grep -v '^\s*#' "$hostfile" | sed -n 's/.*slots=\([0-9]*\).*/\1/p' | paste -sd+ | bc)
acre-train validate "$recipe" "$@" --world-size "$world"
exec deepspeed --hostfile "$hostfile" --master_addr "$master" --master_port "${MASTER_PORT:-29500}" \
  --module acre_train.train "$recipe" "$@"
