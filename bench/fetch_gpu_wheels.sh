#!/usr/bin/env bash
# Download, on a machine with network access, the Python wheels bench/gpu_check.sh installs on a
# GPU machine that cannot fetch packages: torch-memory-saver (the memory-saver GPU test) and the
# HTTP server's packages (tests/serving's GPU tests). They go to .whl/ (git-ignored; carry it to
# the GPU machine beside the working tree). Versions: the ones this project's tests run with.
# Usage: bash bench/fetch_gpu_wheels.sh [PYTHON_VERSION]    (default 3.12, the GPU image's)
set -euo pipefail
cd "$(dirname "$0")/.."
python_version="${1:-3.12}"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> "$(git rev-parse --git-common-dir)/info/exclude"
wheels=(torch-memory-saver==0.0.10 pyzmq==27.3.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 h11==0.16.0
        prometheus_client==0.26.0 httpx==0.28.1 httpcore==1.0.9 anyio==4.16.0 sniffio==1.3.1 click==8.5.1
        orjson==3.8.3 openai==3.57.0)
python3 -m pip download --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${wheels[@]}"
ls -la .whl
