"""Measure greedy acceptance of a draft against a target on held-out code.

    python -m training.acceptance --target models/target --draft models/draft

For each k, every prompt is continued greedily with speculation (the real draft and target
engines, in-process); acceptance is accepted drafts / drafted tokens over all rounds.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.config import ModelSpec
from training.corpus import held_out_prompts
from replicas.engines.huggingface import DraftEngine, TargetEngine
from replicas.engines.huggingface.loading import load_causal_lm
from replicas.tokenizer import load_tokenizer
from replicas.protocol import ProposeRequest, VerifyRequest
from replicas.sampling import GREEDY


@dataclass
class Tally:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.generated / self.rounds if self.rounds else 0.0


def speculate(draft: DraftEngine, target: TargetEngine, prompt: list[int], k: int,
              new_tokens: int, tally: Tally, seq_id: str) -> list[int]:
    tokens = list(prompt)
    while len(tokens) - len(prompt) < new_tokens:
        k_now = min(k, new_tokens - (len(tokens) - len(prompt)) - 1)
        drafts = draft.propose([ProposeRequest(seq_id, tokens, k_now, GREEDY, 0)])[0].tokens if k_now > 0 else []
        [verdict] = target.verify([VerifyRequest(seq_id, tokens, drafts, None, GREEDY, 0)])
        tally.rounds, tally.drafted = tally.rounds + 1, tally.drafted + len(drafts)
        tally.accepted += verdict.accepted
        tally.generated += len(verdict.tokens)
        tokens += verdict.tokens
    draft.release(seq_id)
    target.release(seq_id)
    return tokens[len(prompt):]


def measure(target_dir: Path, draft_dir: Path, ks: list[int], prompts: int, prompt_tokens: int,
            new_tokens: int) -> dict[int, Tally]:
    tokenizer = load_tokenizer(target_dir)
    target = TargetEngine.on_model(load_causal_lm(ModelSpec(path=target_dir)), max_cached_tokens=4096)
    draft = DraftEngine.on_model(load_causal_lm(ModelSpec(path=draft_dir)), max_cached_tokens=4096)
    inputs = held_out_prompts(tokenizer, prompts, prompt_tokens)
    results = {}
    for k in ks:
        tally = Tally()
        for i, prompt in enumerate(inputs):
            speculate(draft, target, prompt, k, new_tokens, tally, f"p{i}")
        results[k] = tally
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=Path("models/target"))
    parser.add_argument("--draft", type=Path, default=Path("models/draft"))
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 6, 8])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = measure(args.target, args.draft, args.k, args.prompts, args.prompt_tokens, args.new_tokens)
    print(f"held-out greedy acceptance, {args.prompts} prompts x {args.new_tokens} new tokens")
    print(f"{'k':>3} {'acceptance':>11} {'tokens/round':>13}")
    for k, tally in results.items():
        print(f"{k:>3} {tally.acceptance:>11.3f} {tally.tokens_per_round:>13.2f}")


if __name__ == "__main__":
    main()
