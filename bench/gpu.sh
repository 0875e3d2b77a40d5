#!/usr/bin/env bash
# GPU benchmarks on the lent H200 (`make bench-gpu`), in one device call after the
# two-part vLLM carry (../shared/gpu/README.md): carry `.vc/c0` in a first call,
# then `.vc/c1` and `.vc/whl` (bench/gpu-wheels.sh fills it) in the call running:
#   bash bench/gpu.sh [--shape qwen3-8b] [other trace_overhead.py options]
# Runs the server and the load generator on that machine; results go to
# bench/results/ and, when $OUT is set, to $OUT as well.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/gpu-env.sh
out=${OUT:-bench/results}
python3 bench/trace_overhead.py --out-dir "$out" "$@"
