#!/usr/bin/env bash
# Regenerates the Python code of every .proto under protos/ (messages, gRPC
# stubs, type stubs) into the repository root: protos/tandem/internal/v1/x.proto
# becomes tandem/internal/v1/x_pb2.py, x_pb2_grpc.py and x_pb2.pyi.
# The generated files are checked in and never edited by hand;
# tests/test_protos.py regenerates into a temp dir and fails when they differ.
#   bash scripts/gen_protos.sh          regenerate in place
#   bash scripts/gen_protos.sh DIR      write into DIR instead (what the test does)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-.}
mapfile -t files < <(find protos -name '*.proto' | LC_ALL=C sort)
if [ "${#files[@]}" -eq 0 ]; then
  echo "no .proto files under protos/" >&2
  exit 1
fi
"$PY" -m grpc_tools.protoc -I protos --python_out="$OUT" --grpc_python_out="$OUT" \
  --pyi_out="$OUT" "${files[@]}"
