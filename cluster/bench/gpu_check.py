"""The GPU checklist, one command for a lent GPU machine that has torch and transformers but
no Ray and no package registry (copy the repository there and run it from its root):

    python -m cluster.bench.gpu_check --out gpu_check.json

In order, each part timed and recorded as it ends, within --budget-s (a part that would start
after it is recorded as skipped):
1. exactness on the device, with tiny random pairs in float32: greedy speculation on the
   engines, eager and compiled (`models.*.compile: on`), equals Hugging Face's greedy
   generate() of the target alone for k 1, 3 and 5; sampled speculation's first two tokens
   fit the target's exact joint distribution (chi-square at 0.1 %; the reference is a plain
   softmax of full forward passes, temperature 1).
2. the engine alone for random-weight Llamas of real sizes (--sizes, default 1.5b and 8b, in
   bfloat16): eager and compiled ms per forward at 1, 8 and 32 sequences of 1 and 5 new
   positions over 512 cached ones, against a plain transformers forward and the weight-read
   floor (cluster/bench/engine.py), with each size's compile time.
Exits 1 when an exactness check fails. Also runs on a CPU (--device cpu --sizes tiny) as a
smoke test of itself.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cluster.bench.chi_square import chi_square_p_value
from cluster.bench.engine import measure, random_llama

ALPHA = 1e-3
VOCAB = 8            # the sampled check enumerates V x V outcomes
PROMPT = [1, 2, 3]


def tiny_pair(device: torch.device, vocab: int, seed: int):
    from training.tiny_models import tiny_llama

    target = tiny_llama("target", vocab, eos_token_id=0, seed=seed, initializer_range=0.15)
    draft = tiny_llama("draft", vocab, eos_token_id=0, seed=seed + 1, initializer_range=0.15)
    return target.to(device), draft.to(device)


def engines(target, draft, compiled: bool):
    from replicas.engines.huggingface import DraftEngine, TargetEngine

    return (DraftEngine.on_model(draft, max_cached_tokens=4000, max_seq_len=128, compiled=compiled),
            TargetEngine.on_model(target, max_cached_tokens=4000, max_seq_len=128, compiled=compiled))


def greedy_alone(target, prompt: list[int], max_tokens: int) -> list[int]:
    """Hugging Face's greedy generate() of the target alone, up to EOS."""
    out = target.generate(torch.tensor([prompt], device=target.device), max_new_tokens=max_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    return out[:out.index(0) + 1] if 0 in out else out


def speculate(drafter, verifier, prompt: list[int], k: int, seq_id: str, max_tokens: int) -> list[int]:
    """Greedy speculative rounds on the engines, up to EOS or max_tokens."""
    from replicas.protocol import ProposeRequest, VerifyRequest
    from replicas.sampling import GREEDY

    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_tokens and (len(tokens) == len(prompt) or tokens[-1] != 0):
        [proposal] = drafter.propose([ProposeRequest(seq_id, tokens, k, GREEDY, seed=0)])
        [verdict] = verifier.verify([VerifyRequest(seq_id, tokens, proposal.tokens, None, GREEDY, 0)])
        tokens += verdict.tokens
    out = tokens[len(prompt):len(prompt) + max_tokens]
    return out[:out.index(0) + 1] if 0 in out else out


GREEDY_PROMPTS = [list(range(5, 25)), [3, 9, 4, 11, 2, 8], list(range(40, 12, -1))]


def greedy_matches(device: torch.device, compiled: bool, max_tokens: int = 32) -> dict:
    """Greedy speculation against the target alone, for k 1, 3, 5, on three prompts."""
    target, draft = tiny_pair(device, 64, seed=3)
    drafter, verifier = engines(target, draft, compiled)
    mismatches = [{"k": k, "prompt": i} for k in (1, 3, 5) for i, prompt in enumerate(GREEDY_PROMPTS)
                  if speculate(drafter, verifier, prompt, k, f"k{k}-{i}", max_tokens)
                  != greedy_alone(target, prompt, max_tokens)]
    return {"ok": not mismatches, "mismatches": mismatches, "compile_s": verifier.describe()["compile_s"]}


@torch.inference_mode()
def sampled_fits(device: torch.device, samples: int = 2000, batch: int = 8, k: int = 3) -> dict:
    """The first two tokens of sampled speculation against P(t1, t2 | PROMPT) by enumeration."""
    from replicas.protocol import ProposeRequest, VerifyRequest
    from replicas.sampling import SamplingParams

    target, draft = tiny_pair(device, VOCAB, seed=21)
    drafter, verifier = engines(target, draft, compiled=False)
    params = SamplingParams(temperature=1.0)
    first = torch.softmax(target(torch.tensor([PROMPT], device=device)).logits[0, -1].float(), -1)
    seconds = target(torch.tensor([PROMPT + [t] for t in range(VOCAB)], device=device)).logits[:, -1].float()
    exact = first[:, None] * torch.softmax(seconds, -1)
    counts = torch.zeros(VOCAB, VOCAB)
    for start in range(0, samples, batch):
        sequences = {i: list(PROMPT) for i in range(start, start + batch)}
        round_index = 0
        while open_ := [i for i, tokens in sequences.items() if len(tokens) < len(PROMPT) + 2]:
            proposals = drafter.propose([ProposeRequest(f"s{i}", sequences[i], k, params, seed=i * 7919 + round_index)
                                         for i in open_])
            verdicts = verifier.verify([VerifyRequest(f"s{i}", sequences[i], p.tokens, p.probs, params,
                                                      seed=i * 104729 + round_index) for i, p in zip(open_, proposals)])
            for i, verdict in zip(open_, verdicts):
                sequences[i] += verdict.tokens
            round_index += 1
        for i, tokens in sequences.items():
            counts[tokens[len(PROMPT)], tokens[len(PROMPT) + 1]] += 1
            drafter.release(f"s{i}")
            verifier.release(f"s{i}")
    p_value = chi_square_p_value(counts, exact)
    return {"ok": p_value > ALPHA, "p_value": p_value, "samples": samples}


def engine_figures(size: str, device: torch.device, dtype: torch.dtype, context: int, repeats: int) -> dict:
    model = random_llama(size, device, dtype)
    started = time.perf_counter()
    report = measure(model, device, [1, 8, 32], [1, 5], context, repeats, compiled=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", nargs="*", default=["1.5b", "8b"], help="random Llama sizes (cluster/bench/engine.py)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=450.0, help="no part starts after this (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    args = parser.parse_args(argv)
    device, started = torch.device(args.device), time.perf_counter()
    report: dict = {"device": str(device), "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "parts": {}}
    parts = [("greedy_eager", lambda: greedy_matches(device, compiled=False)),
             ("greedy_compiled", lambda: greedy_matches(device, compiled=True)),
             ("sampled_chi_square", lambda: sampled_fits(device))]
    parts += [(f"engine_{size}", lambda size=size: engine_figures(size, device, getattr(torch, args.dtype),
                                                                  args.context, args.repeats)) for size in args.sizes]
    for name, part in parts:
        if time.perf_counter() - started > args.budget_s:
            report["parts"][name] = {"skipped": f"over the {args.budget_s:.0f} s budget"}
        else:
            began = time.perf_counter()
            try:
                report["parts"][name] = {**part(), "part_s": round(time.perf_counter() - began, 1)}
            except Exception as exc:  # noqa: BLE001 - recorded, and the other parts still run
                report["parts"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        args.out.write_text(json.dumps(report, indent=2))      # what is done survives a cut-off
        print(f"{name}: {json.dumps(report['parts'][name])[:400]}", flush=True)
    failed = [name for name, part in report["parts"].items() if part.get("ok") is False]
    print(f"gpu_check: {'failed: ' + ', '.join(failed) if failed else 'ok'} in {time.perf_counter() - started:.0f} s "
          f"({args.out})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
