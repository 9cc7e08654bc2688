#!/usr/bin/env bash
# GuideLLM against a fresh `specserve up` (default cluster.yaml), then against vLLM's own OpenAI
# server on the same pair, one after the other, completions and chat, 1 and 4 streams
# (docs/BENCHMARKS.md, "GuideLLM against the default cluster"). Run from the repository root:
#   GUIDELLM=/tmp/glv/bin/guidellm VLLM_PYTHON=/tmp/vllm-venv/bin/python OUT=/tmp/gl \
#       bash experiments/guidellm_side_by_side.sh
set -uo pipefail
GUIDELLM=${GUIDELLM:-guidellm}
VLLM_PYTHON=${VLLM_PYTHON:-/tmp/vllm-venv/bin/python}
OUT=${OUT:-/tmp/gl}
mkdir -p "$OUT"
source "$(dirname "$0")/side_by_side.sh"

run_guidellm() {  # $1 base URL, $2 label
  for fmt in completions chat; do
    path=/v1/completions; [ "$fmt" = chat ] && path=/v1/chat/completions
    HF_HUB_OFFLINE=1 timeout 400 "$GUIDELLM" run --backend "kind=openai_http,target=$1,request_format=$path" \
      --profile kind=concurrent --override profile.streams 1,4 \
      --data kind=synthetic_text,prompt_tokens=128,output_tokens=64 \
      --tokenizer kind=huggingface_auto,model=models/target --constraint kind=max_requests,count=16 \
      --output "kind=json,path=$OUT/$2-$fmt.json" --disable-console-interactive > "$OUT/$2-$fmt.log" 2>&1
    echo "$2 $fmt: exit $? (tables in $OUT/$2-$fmt.log)"
  done
}

start_specserve
run_guidellm http://127.0.0.1:8000 specserve
stop_specserve

start_vllm
run_guidellm http://127.0.0.1:8100 vllm
stop_vllm
