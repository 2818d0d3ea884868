#!/usr/bin/env bash
# Several nodes with the DeepSpeed launcher. Same paths on every node; output_root on a shared
# filesystem so every rank writes into the same checkpoint directory.
#
#   launch/multi_node.sh hostfile recipes/qwen2.5-7b_stage1.yaml [key=value ...]
#       run once, on the first host: starts every node over passwordless ssh (pdsh)
#   NODE_RANK=k launch/multi_node.sh hostfile recipes/qwen2.5-7b_stage1.yaml [key=value ...]
#       run on every node k = 0..N-1 yourself (no ssh: SLURM steps, containers, clusters without ssh)
#
# hostfile lines look like "node1 slots=8" (slots = processes on that node). MASTER_ADDR defaults to
# the first host, MASTER_PORT to 29500. If a node dies, the others stop with "lost contact with the
# other ranks" within train.dist_timeout_s (default 600 s; a dead peer's closed connection is
# noticed at once) instead of hanging: relaunch every node with checkpoint.resume_from_checkpoint=latest.
set -euo pipefail
hostfile=${1:?usage: $0 HOSTFILE RECIPE [key=value ...]}; recipe=${2:?usage: $0 HOSTFILE RECIPE [key=value ...]}; shift 2
master=${MASTER_ADDR:-$(grep -v '^\s*#' "$hostfile" | awk 'NF{print $1; exit}')}
world=$(grep -v '^\s*#' "$hostfile" | sed -n 's/.*slots=\([0-9]*\).*/\1/p' | awk '{s+=$1} END{print s}')
acre-train validate "$recipe" "$@" --world-size "$world"
mode=()
if [[ -n "${NODE_RANK:-}" ]]; then
  mode=(--no_ssh --node_rank "$NODE_RANK")
fi
exec deepspeed --hostfile "$hostfile" "${mode[@]}" --master_addr "$master" --master_port "${MASTER_PORT:-29500}" \
  --module acre_train.train "$recipe" "$@"
