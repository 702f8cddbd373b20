#!/usr/bin/env bash
# The CUDA half of the LLM calibration benchmarks, for a machine with a GPU and PyTorch, transformers, onnx and
# onnxruntime installed (mqbench run from this checkout, no install): the pipeline's CUDA tests, then
# benchmarks/llm_scale.py with GPTQ and AWQ run block by block on the GPU (their `device` key) beside the same
# runs on the machine's CPUs, and TinyLlama-1.1B's shape on the GPU.
# Writes the JSON files to benchmarks/results/ (or to $1 if given) and prints the tables.
#   bash benchmarks/cuda_run.sh [results folder]
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
export PYTHONPATH="$here/src:$here/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
results=${1:-}
py=${PYTHON:-python3}
threads=$(nproc)
out() { if [ -n "$results" ]; then cp "benchmarks/results/$1.json" "$results/" 2>/dev/null; fi; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$py" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
timeout 120 "$py" -m pytest -q -p no:cacheprovider tests/advanced_ptq/test_pipeline.py -k "cuda or device" 2>&1 | tail -5
timeout 150 "$py" benchmarks/llm_scale.py --parts scaling --algorithms gptq,awq --blocks 4,8,16,32 --awq-blocks 4,8,16,32 \
  --whole "" --device cuda --threads "$threads" --output llm_scale_cuda
out llm_scale_cuda
timeout 180 "$py" benchmarks/llm_scale.py --parts tinyllama --device cuda --threads "$threads" --output llm_scale_cuda_tinyllama
out llm_scale_cuda_tinyllama
timeout 100 "$py" benchmarks/llm_scale.py --parts scaling --algorithms gptq,awq --blocks 4,8,16 --awq-blocks 4 \
  --whole "" --threads "$threads" --output llm_scale_cuda_host
out llm_scale_cuda_host
