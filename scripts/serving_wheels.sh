#!/bin/bash
# Download the wheels the GPU machine needs to run `attnserve serve` and `bench.serving`
# (it has torch, transformers, httpx and pytest, no internet): what `pip install
# attnserve[server,bench]` gives a user, for CPython 3.12 on manylinux x86-64.
#
#   bash scripts/serving_wheels.sh [DIR]     (default .whl/serving; keep it out of git)
#
# Carry DIR with the device call (`carry: [".whl/serving"]`); `scripts/gpu_engine_bench.sh
# serving` installs it and refuses to measure without uvloop / httptools / aiohttp.
set -euo pipefail
dir=${1:-.whl/serving}
mkdir -p "$dir"
py=${PYTHON:-python3}
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" \
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  uvicorn==0.54.0 httptools==0.9.0 uvloop==0.23.0 prometheus-client==0.26.0 \
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 \
  multidict==7.2.1 propcache==0.5.4 yarl==1.25.1
du -sh "$dir"
