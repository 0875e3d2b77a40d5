#!/usr/bin/env bash
# Fetches, here, the wheels bench/gpu.sh installs on the device machine (Python 3.12,
# x86-64) into .vc/whl: grpcio new enough for the generated code, and grpcio's
# health, reflection and status packages, google-re2 (text conditions) and httptools (the
# HTTP port's protocol, when --http-port is on), which that machine lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .vc/whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .vc/whl grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
  grpcio-status==1.85.1 googleapis-common-protos==1.76.0 google-re2==1.1.20251105 httptools==0.7.1
ls .vc/whl
