#!/usr/bin/env bash
# The engine tests on the lent H200 (vLLM's CUDA build, no venv there), after the two-part
# vLLM carry (../shared/gpu/README.md): carry .vc/c0 in a first call, then .vc/c1 and .vc/whl
# (bench/gpu-wheels.sh) in the call running
#   bash tests/gpu.sh [pytest arguments]    (default: the trace and hidden-states tests)
# The machine has pytest, transformers and httpx but not the HTTP port's packages, so the
# test servers run without the HTTP and metrics ports (tests/conftest.py); tests that need them
# fail there.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/gpu-env.sh
# The tests compare per-step logits with transformers (float32, eager attention) at 2e-3.
# vLLM's default float32 attention on Hopper is its Triton kernel, whose dot products run in
# TF32 (tl.dot's default input precision for float32, a 10-bit mantissa): on an H200 with vLLM 0.26, six trace tests
# missed by up to 3.2e-3. FlexAttention computes in float32 and passes.
# Some tests start a second server beside the session's: each takes a tenth of the GPU's memory
# (vLLM's default, 0.92, leaves the second too little to start).
export TRACEWIRE_TEST_ENGINE_ARGS=${TRACEWIRE_TEST_ENGINE_ARGS:---attention-backend FLEX_ATTENTION --gpu-memory-utilization 0.1}
if [ $# -eq 0 ]; then set -- tests/test_trace.py tests/test_hidden_states.py; fi
python3 -m pytest -q -p no:cacheprovider "$@"
