#!/bin/sh
# The wheels the GPU machine lacks for `python3 bench/gpu.py --engine`, downloaded here (it cannot
# reach PyPI). Its image has Python 3.12 with torch, numpy, safetensors, typer, fsspec and
# matplotlib; the engine also needs cryptography (Ed25519 signatures), which needs cffi and
# pycparser. The static engine does not import torchft (elastic membership only).
#
#   sh bench/gpu_wheels.sh            # -> .gpu-wheels/ (git-ignored)
#
# then, in one device call that carries .gpu-wheels:
#
#   python3 -m pip install --no-index --find-links .gpu-wheels cryptography &&
#   PYTHONPATH=src python3 bench/gpu.py --engine --out $OUT/gpu.json &&
#   python3 bench/tensor_hash.py --out $OUT/tensor_hash.json
#
# (the last: the tree hash on the GPU host's cores against one sha256 stream, host memory only)
set -eu
dest=${1:-.gpu-wheels}
python3 -m pip download --dest "$dest" --only-binary=:all: --no-deps --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 \
    "cryptography>=42" cffi pycparser
