#!/usr/bin/env bash
# GRPO on GSM8K with PrefixFlow as verl's actor engine, on a GPU node (Ray + vLLM). Not run here (no GPU).
# Needs: pip install verl==0.9.1 vllm (a CUDA torch build, as verl's docs say) and this repo (pip install -e .).
# Data: python -m verl.examples.data_preprocess.gsm8k --local_dir "$HOME/data/gsm8k" (verl's own script).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-Qwen/Qwen3-8B}
DATA=${DATA:-$HOME/data/gsm8k}
python -m verl.trainer.main_ppo \
  --config-path="$PWD/examples/verl" --config-name=grpo_prefixflow \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  data.train_batch_size=256 data.max_prompt_length=1024 data.max_response_length=1024 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
  trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.total_epochs=15 \
  trainer.logger='[console]' trainer.project_name=prefixflow_verl trainer.experiment_name=grpo_gsm8k "$@"
