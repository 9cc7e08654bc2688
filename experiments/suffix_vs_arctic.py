"""Suffix drafts, ours (replicas/drafting/suffix.py) against Arctic Inference's SuffixDecodingCache (its
C++ suffix trees), offline: the bundled target's greedy 96-token answers to the 16 held-out
prompts, k = 4, tokens a round by greedy acceptance against the known answer, and
microseconds a draft call. Pass 1: each prompt once, every answer added to the caches as it
is generated; pass 2: the same prompts again (docs/BENCHMARKS.md).

arctic-inference is on PyPI as an sdist only, whose build asks for torch>=2.10 in pip's
isolated build environment (a CUDA build from PyPI); its suffix trees alone build in seconds:

    pip download arctic-inference==0.3.0 nanobind==2.9.2 --no-deps -d A && tar xzf A/arctic_inference-0.3.0.tar.gz -C A
    python3 -m venv A/venv && A/venv/bin/pip install A/nanobind-2.9.2-*.whl
    cd A/arctic_inference-0.3.0/csrc/suffix_decoding && cmake -B build -DPython_EXECUTABLE=$A/venv/bin/python && make -C build
    mkdir -p A/pkg/arctic_inference/suffix_decoding && touch A/pkg/arctic_inference/__init__.py
    cp A/arctic_inference-0.3.0/arctic_inference/suffix_decoding/*.py build/_C*.so A/pkg/arctic_inference/suffix_decoding/
    python -m experiments.suffix_vs_arctic A/pkg
"""
import sys
import time

import numpy as np
import torch

from cluster.config import ModelSpec
from replicas.engines.huggingface.loading import load_causal_lm
from replicas.tokenizer import load_tokenizer
from replicas.drafting.suffix import OutputCache, suffix_drafts
from training.corpus import held_out_prompts

K, NEW = 4, 96


def greedy_answers() -> tuple[list[list[int]], list[list[int]]]:
    torch.set_num_threads(1)
    tokenizer = load_tokenizer("models/target")
    model = load_causal_lm(ModelSpec(path="models/target", dtype="float32"))
    prompts = held_out_prompts(tokenizer, count=16, prompt_tokens=128)
    with torch.no_grad():
        answers = [model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                                  do_sample=False)[0, len(p):].tolist() for p in prompts]
    return prompts, answers


def rounds(prompts, answers, draft, start, grew, finish) -> None:
    """Two passes over the prompts; each round keeps the drafts that equal the answer's next
    tokens, plus one token (the target's own)."""
    times_us = []
    for number in (1, 2):
        count = tokens = 0
        for i, (prompt, answer) in enumerate(zip(prompts, answers)):
            request = f"{number}-{i}"
            start(request, prompt)
            done = 0
            while done < len(answer):
                started = time.perf_counter()
                drafts = draft(request, prompt + answer[:done])[:K]
                times_us.append((time.perf_counter() - started) * 1e6)
                kept = 0
                while kept < len(drafts) and done + kept < len(answer) and drafts[kept] == answer[done + kept]:
                    kept += 1
                step = min(kept + 1, len(answer) - done)
                grew(request, answer[done:done + step])
                done, count, tokens = done + step, count + 1, tokens + step
            finish(request, prompt, answer)
        print(f"  pass {number}: {tokens / count:.2f} tokens a round")
    times_us.sort()
    print(f"  a draft call: median {times_us[len(times_us) // 2]:.1f} us, p99 {times_us[int(len(times_us) * .99)]:.1f} us")


def main(arctic_folder: str) -> None:
    sys.path.insert(0, arctic_folder)
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    prompts, answers = greedy_answers()
    print("replicas/drafting/suffix.py:")
    ours = OutputCache(16384)
    rounds(prompts, answers, lambda request, context: suffix_drafts(context, K, ours),
           lambda request, prompt: None, lambda request, new: None, lambda request, prompt, answer: ours.add(prompt, answer))
    print("Arctic Inference's SuffixDecodingCache:")
    arctic = SuffixDecodingCache(max_tree_depth=64, max_cached_requests=-1)
    rounds(prompts, answers,
           lambda request, context: arctic.speculate(request, np.array(context[-64:], dtype=np.int32),
                                                     max_spec_tokens=K).token_ids,
           lambda request, prompt: arctic.start_request(request, np.array(prompt, dtype=np.int32)),
           lambda request, new: arctic.add_active_response(request, np.array(new, dtype=np.int32)),
           lambda request, prompt, answer: arctic.stop_request(request))


if __name__ == "__main__":
    main(sys.argv[1])
