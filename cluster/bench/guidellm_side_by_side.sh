#!/usr/bin/env bash
# GuideLLM against a fresh `specserve up` (default cluster.yaml), then against vLLM's own OpenAI
# server on the same pair, one after the other, completions and chat, 1 and 4 streams
# (docs/BENCHMARKS.md, "GuideLLM against the default cluster"). Run from the repository root:
#   GUIDELLM=/tmp/glv/bin/guidellm VLLM_PYTHON=/tmp/vllm-venv/bin/python OUT=/tmp/gl \
#       bash cluster/bench/guidellm_side_by_side.sh
set -uo pipefail
GUIDELLM=${GUIDELLM:-guidellm}
VLLM_PYTHON=${VLLM_PYTHON:-/tmp/vllm-venv/bin/python}
OUT=${OUT:-/tmp/gl}
mkdir -p "$OUT"
# specserve's plain chat template (router/admission.py), for vLLM's chat endpoint
printf "{%% for m in messages %%}{{ m['role'] }}: {{ m['content'] }}\n{%% endfor %%}assistant:" > "$OUT/plain.jinja"

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

.venv/bin/ray stop --force > /dev/null 2>&1
.venv/bin/specserve up > "$OUT/specserve-up.log" 2>&1 &
up=$!
for _ in $(seq 120); do grep -q "specserve is up" "$OUT/specserve-up.log" && break; sleep 2; done
run_guidellm http://127.0.0.1:8000 specserve
kill "$up"; sleep 5; .venv/bin/ray stop --force > /dev/null 2>&1

HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \
  --model models/target --served-model-name specserve --port 8100 --max-model-len 512 \
  --chat-template "$OUT/plain.jinja" \
  --speculative-config '{"model": "models/draft", "num_speculative_tokens": 4, "method": "draft_model"}' \
  > "$OUT/vllm.log" 2>&1 &
vllm=$!
for _ in $(seq 150); do curl -s http://127.0.0.1:8100/v1/models > /dev/null 2>&1 && break; sleep 2; done
run_guidellm http://127.0.0.1:8100 vllm
kill "$vllm"
