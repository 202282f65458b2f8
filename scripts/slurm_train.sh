#!/bin/bash
# Multi-node training under Slurm: one launcher per node (python train.py with torchrun's flags,
# trainer/lifecycle/launch.py: torch's elastic agent in process), rendezvous over c10d.
#
#   sbatch --nodes=8 scripts/slurm_train.sh train_configs/llama3_70b.toml [--section.key value ...]
#
#SBATCH --job-name=meshtrain
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --exclusive
#SBATCH --output=slurm-%j.out
set -euo pipefail

CONFIG=${1:?usage: sbatch --nodes=N scripts/slurm_train.sh CONFIG [overrides...]}
shift
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RDZV_PORT=${RDZV_PORT:-29500}

# Each node runs one launcher; they meet at the head node and the agents assign global ranks
# node by node, so the tp groups (innermost in ParallelDims) stay inside a node. A bad config
# ends on every node before any worker starts (one line, exit code 2); scancel's SIGTERM
# stops the workers at a step with a checkpoint (the same sbatch command resumes).
srun --kill-on-bad-exit=1 .venv/bin/python train.py \
    --nnodes="$SLURM_NNODES" \
    --nproc_per_node="$GPUS_PER_NODE" \
    --rdzv_id="$SLURM_JOB_ID" \
    --rdzv_backend=c10d \
    --rdzv_endpoint="$HEAD_NODE:$RDZV_PORT" \
    --config "$CONFIG" "$@"
