#!/usr/bin/env bash
# GPU benchmarks on the lent H200 (`make bench-gpu`), in one device call after the
# two-part vLLM carry (../shared/gpu/README.md): carry `.vc/c0` in a first call,
# then `.vc/c1` and `.vc/whl` (bench/gpu-wheels.sh fills it) in the call running:
#   bash bench/gpu.sh [--shape qwen3-8b] [other trace_overhead.py options]
# Runs the server and the load generator on that machine; results go to
# bench/results/ and, when $OUT is set, to $OUT as well.
set -euo pipefail
cd "$(dirname "$0")/.."
VC=${VC:-/tmp/vc}
if [ ! -f /tmp/site/vllm/__init__.py ]; then
  [ -f "$VC/core.part.00" ] || { echo "no vLLM: carry .vc/c0 to $VC first (see ../shared/gpu/README.md)"; exit 3; }
  cp .vc/c1/* "$VC"/ && bash "$VC/unpack.sh" "$VC" >/dev/null
fi
# The machine's grpcio is older than the generated code needs, and grpcio's health,
# reflection and status packages are missing there: carried as wheels.
if [ ! -f /tmp/tw/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tw .vc/whl/grpcio_* .vc/whl/googleapis_* .vc/whl/google_re2-* .vc/whl/httptools-*
  too_old=$(PYTHONPATH=/tmp/site python3 -c "
import grpc, google.protobuf as p
v = lambda s: tuple(int(x) for x in s.split('.')[:3])
print(' '.join(w for w, old in (('.vc/whl/grpcio-1*', v(grpc.__version__) < (1, 85, 1)),
                                ('.vc/whl/protobuf-*', v(p.__version__) < (7, 35, 1))) if old))")
  [ -z "$too_old" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tw $too_old
  touch /tmp/tw/.done
fi
export PYTHONPATH=/tmp/tw:/tmp/site:$PWD/service/src:$PWD/clients/python/src:$PWD/contract/python/src
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=WARNING
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import grpc, torch, vllm; print('grpcio', grpc.__version__, 'torch', torch.__version__, 'vllm', vllm.__version__)"
out=${OUT:-bench/results}
python3 bench/trace_overhead.py --out-dir "$out" "$@"
