# Sourced by bench/gpu.sh and tests/gpu.sh on the lent H200: unpacks the carried vLLM
# (../shared/gpu/README.md: .vc/c0 in a first call, .vc/c1 and .vc/whl in the next) once per
# machine, installs the carried wheels, and exports the PYTHONPATH and environment that
# vLLM and tracewire need there. Run from the repository root.
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
