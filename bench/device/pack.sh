#!/bin/bash
# Pack what bench/device/run.sh needs on a bare Python 3.12 x86-64 machine with no package registry, into .dev/
# (ignored by git: .git/info/exclude), within the device tool's 64 MiB working-tree limit:
#   .dev/site.tar.gz   openvino (CPU plugin and the IR, PyTorch and ONNX front ends only), openvino-tokenizers,
#                      nncf, msgspec, gguf and pydot, installed for cp312 manylinux (ovshard itself runs from the
#                      checkout that travels with every call: run.sh lays it out as a package)
#   .dev/llama.tar.gz  llama.cpp's source as the llama-cpp-python sdist vendors it (bench/peers.py's cache),
#                      without docs, models, tests, UI assets and the GPU back ends
#   .dev/stories/      stories260K's tokenizer files, lent to the random-weight shapes
# Run from the repository root, after `make bench-peers` has fetched the llama.cpp source once.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.dev/' .git/info/exclude 2>/dev/null || echo '/.dev/' >> .git/info/exclude
rm -rf .dev && mkdir -p .dev/whl .dev/stories
PY=${PY:-.venv/bin/python}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .dev/whl \
  openvino==2026.4.1 openvino-tokenizers==2026.4.1.0 openvino-telemetry nncf==3.4.0 msgspec==0.23.0 gguf==0.19.0 \
  pydot==4.0.1
site=$(mktemp -d)
"$PY" -m pip install -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --target "$site/site" .dev/whl/*.whl
libs="$site/site/openvino/libs"
rm -f "$libs"/libopenvino_intel_gpu_plugin.so "$libs"/libopenvino_intel_npu_plugin.so "$libs"/cache.json \
  "$libs"/libopenvino_tensorflow*_frontend.so* "$libs"/libopenvino_paddle_frontend.so* \
  "$libs"/libopenvino_jax_frontend.so* "$libs"/libopenvino_gguf_frontend.so*
tar -C "$site" -czf .dev/site.tar.gz site
rm -rf "$site" .dev/whl
cp ../shared/models/stories260K/{tokenizer.model,tokenizer.json,tokenizer_config.json,special_tokens_map.json} .dev/stories/
src=${LLAMA_SRC:-$HOME/.cache/ovshard/peers/llama-cpp-python-0.3.36/vendor/llama.cpp}
tar -C "$(dirname "$src")" -czf .dev/llama.tar.gz --exclude='llama.cpp/build' --exclude='llama.cpp/docs' \
  --exclude='llama.cpp/models' --exclude='llama.cpp/tests' --exclude='llama.cpp/examples' \
  --exclude='llama.cpp/pocs' --exclude='llama.cpp/benches' --exclude='llama.cpp/media' --exclude='llama.cpp/tools/ui' \
  --exclude='llama.cpp/tools/server/public*' --exclude='llama.cpp/.git' \
  $(for b in cuda vulkan metal sycl cann opencl hexagon webgpu et virtgpu openvino musa hip zdnn kompute; do
      echo "--exclude=llama.cpp/ggml/src/ggml-$b"; done) llama.cpp
du -sh .dev/*
