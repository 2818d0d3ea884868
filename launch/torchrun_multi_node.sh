#!/usr/bin/env bash
# Several nodes with torchrun (c10d rendezvous, no hostfile, no ssh): run on every node.
#
#   NNODES=2 NODE_RANK=k MASTER_ADDR=node0 launch/torchrun_multi_node.sh recipes/qwen2.5-7b_stage1.yaml [key=value ...]
#
# NPROC_PER_NODE (default: the node's GPU count, 1 on CPU) processes per node; node 0 hosts the
# rendezvous at MASTER_ADDR:MASTER_PORT (default 29500). A recipe with train.deepspeed runs ZeRO-1/2
# under torchrun too. If a node dies, the others stop with "lost contact with the other ranks"
# within train.dist_timeout_s instead of hanging; relaunch with checkpoint.resume_from_checkpoint=latest.
set -euo pipefail
recipe=${1:?usage: NNODES=N NODE_RANK=k MASTER_ADDR=HOST $0 RECIPE [key=value ...]}; shift
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
per_node=${NPROC_PER_NODE:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}
[[ "$per_node" -ge 1 ]] || per_node=1
acre-train validate "$recipe" "$@" --world-size $((NNODES * per_node))
is_host=$([[ "$NODE_RANK" == 0 ]] && echo 1 || echo 0)
exec python -m torch.distributed.run --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$per_node" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv_id "${RDZV_ID:-acre}" \
  --rdzv_conf "is_host=$is_host" -m acre_train.train "$recipe" "$@"
