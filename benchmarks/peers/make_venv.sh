#!/usr/bin/env bash
# Makes the scratch venv of a peer library: benchmarks/peers/.venv-NAME (git-ignored), never the project's venv.
#
#   benchmarks/peers/make_venv.sh NAME PACKAGE...
#   benchmarks/peers/make_venv.sh llmcompressor          # the llm-compressor peer's default packages (below)
#
# Steps: `python -m venv` (PYTHON, default python3: 3.11, the interpreter of the local CPU wheel of torch), then
# `pip install -c constraints.txt PACKAGE...`. constraints.txt pins torch==2.13.0: left free, pip would take a
# CUDA build of torch from the index (gigabytes of nvidia-* packages). The venv's `pip freeze` is written to
# .venv-NAME/freeze.txt.
#
# llm-compressor, found by trying: llmcompressor 0.14.0.1 asks for torch>=2.10,<=2.14, transformers>=5.15,<=5.17,
# compressed-tensors==0.19.0, datasets, accelerate, auto-round and nvidia-ml-py (a pure-Python NVML binding, no
# CUDA). With torch pinned the resolver needs no other pin: it settles on transformers 5.17.0, which reads GGUF
# files itself with the `gguf` package (and `accelerate`), so the peer loads SmolLM2's GGUF file directly.
# oneshot, however, reads the model's config again from the model's path (a GGUF file's folder has no
# config.json): llmcompressor_gptq.py writes the dequantized model to a temporary Hugging Face folder (float32
# safetensors) and loads it from there. About 1.5 GB on disk.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
if [ $# -lt 1 ]; then
    echo "usage: $0 NAME [PACKAGE...]" >&2
    exit 2
fi
name=$1
shift
if [ $# -eq 0 ]; then
    case $name in
        llmcompressor) set -- 'llmcompressor==0.14.*' gguf accelerate ;;
        *) echo "no default packages for $name: name them" >&2; exit 2 ;;
    esac
fi
venv="$here/.venv-$name"
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install -c "$here/constraints.txt" "$@"
"$venv/bin/python" -m pip check
"$venv/bin/python" -m pip freeze > "$venv/freeze.txt"
"$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'
echo "made $venv"
