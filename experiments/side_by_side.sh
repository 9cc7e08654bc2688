# Sourced by the side-by-side scripts (guidellm_side_by_side.sh, vllm_bench_side_by_side.sh):
# one server at a time on this machine, a fresh `specserve up` (default cluster.yaml, port 8000)
# and vLLM's own OpenAI server on the same pair speculating 4 tokens with the same draft
# (port 8100), each started and stopped here. Needs OUT and VLLM_PYTHON set.

write_plain_chat_template() {  # specserve's plain chat template (router/admission.py), for vLLM's chat endpoint
  printf "{%% for m in messages %%}{{ m['role'] }}: {{ m['content'] }}\n{%% endfor %%}assistant:" > "$OUT/plain.jinja"
}

start_specserve() {
  .venv/bin/ray stop --force > /dev/null 2>&1
  .venv/bin/specserve up > "$OUT/specserve-up.log" 2>&1 &
  SPECSERVE_PID=$!
  for _ in $(seq 120); do grep -q "specserve is up" "$OUT/specserve-up.log" && break; sleep 2; done
}

stop_specserve() {
  kill "$SPECSERVE_PID"; sleep 5; .venv/bin/ray stop --force > /dev/null 2>&1
}

start_vllm() {
  write_plain_chat_template
  HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \
    --model models/target --served-model-name specserve --port 8100 --max-model-len 512 \
    --chat-template "$OUT/plain.jinja" \
    --speculative-config '{"model": "models/draft", "num_speculative_tokens": 4, "method": "draft_model"}' \
    > "$OUT/vllm.log" 2>&1 &
  VLLM_PID=$!
  for _ in $(seq 150); do curl -s http://127.0.0.1:8100/v1/models > /dev/null 2>&1 && break; sleep 2; done
}

stop_vllm() {
  kill "$VLLM_PID"
}
