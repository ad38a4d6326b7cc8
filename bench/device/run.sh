#!/bin/bash
# On the device machine, from the repository root, with .dev/ (bench/device/pack.sh) carried:
#   bash bench/device/run.sh start     unpack, check the imports, start paper.py in its own session (it outlives
#                                      the call while the machine is held) and return
#   bash bench/device/run.sh wait N    wait up to N seconds for it, print the log's end, copy the results to $OUT
# PAPER_ARGS passes arguments to paper.py (e.g. "--only setup,one").
set -u
W=/tmp/paper
case "${1:-}" in
start)
  mkdir -p "$W"
  [ -d /tmp/site ] || tar -C /tmp -xzf .dev/site.tar.gz
  [ -d /tmp/llama.cpp ] || tar -C /tmp -xzf .dev/llama.tar.gz
  # ovshard from this checkout, laid out as the package pyproject.toml maps (passes/ and runtime/ inside ovshard/)
  rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r ovshard /tmp/pkg/ovshard && cp -r passes /tmp/pkg/ovshard/passes \
    && cp -r runtime /tmp/pkg/ovshard/runtime
  export PYTHONPATH=/tmp/pkg:/tmp/site CI=true PAPER_TOKENIZER_FROM="$PWD/.dev/stories"
  repo=$PWD
  cd /tmp  # python -m ovshard.cli from the checkout would find its ovshard/ (no runtime/ inside) before /tmp/pkg
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Flags" | cut -c1-400
  python3 -c "import openvino, nncf, ovshard, torch, transformers; print('openvino', openvino.get_version(), 'torch', torch.__version__, 'transformers', transformers.__version__)" || exit 1
  setsid nohup python3 "$repo/bench/device/paper.py" --work "$W" --llama-src /tmp/llama.cpp ${PAPER_ARGS:-} \
    > "$W/log" 2>&1 < /dev/null &
  echo "started pid $!"
  ;;
wait)
  end=$((SECONDS + ${2:-540}))
  while [ $SECONDS -lt $end ] && pgrep -f bench/device/paper.py > /dev/null; do sleep 5; done
  pgrep -f bench/device/paper.py > /dev/null && echo RUNNING || echo FINISHED
  tail -n 60 "$W/log"
  cp "$W/paper.json" "$W/log" "$OUT/" 2>/dev/null; cp "$W/paper.md" "$OUT/" 2>/dev/null
  (cd "$W" && tar -czf "$OUT/profiles.tar.gz" profiles kernels 2>/dev/null)
  ;;
*) echo "usage: run.sh start|wait SECONDS" >&2; exit 2 ;;
esac
