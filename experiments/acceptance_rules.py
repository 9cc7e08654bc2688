"""What each engine's acceptance rule keeps of a draft, per position, on held-out text.

    python -m experiments.acceptance_rules [--temperatures 0.7 1.0] [--prompts 32] [--noise-draws 64]

- huggingface engine: the draft x is sampled from the draft's q and kept with min(1, p(x)/q(x)),
  so a position keeps its draft with probability sum_x min(p(x), q(x)) (1 - total variation).
- vLLM engine (replicas/engines/vllm/proposer.py): the draft is q's argmax, sent without q, and vLLM
  keeps it with p(x) (a one-hot q).
- seeded requests on the huggingface engine (replicas/gumbel.py): the draft is q's Gumbel-max
  choice under the position's public noise, kept when it equals p's choice under the same
  noise: P(argmax q / E == argmax p / E), estimated over `--noise-draws` noises per position.
All three are exact; they differ in how often a draft is kept at temperature > 0 (greedy requests
keep the same drafts under both). p and q are the target's and the draft's distributions at
that temperature, at every position after the 20th of each held-out prompt.
"""

from __future__ import annotations

import argparse
import json

import torch


def keep_rates(target, draft, prompts: list[list[int]], temperature: float, noise_draws: int = 64) -> dict[str, float]:
    from replicas.gumbel import exponential_noise

    q_rule, one_hot, gumbel = [], [], []
    with torch.inference_mode():
        for number, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            p = torch.softmax(target(ids).logits[0, 20:].float() / temperature, -1)
            q = torch.softmax(draft(ids).logits[0, 20:].float() / temperature, -1)
            q_rule.append(torch.minimum(p, q).sum(-1))
            one_hot.append(p.gather(-1, q.argmax(-1, keepdim=True))[:, 0])
            positions = torch.arange(p.shape[0])
            same = [((p.double() / noise).argmax(-1) == (q.double() / noise).argmax(-1)).double()
                    for noise in (exponential_noise(number * noise_draws + s, positions, p.shape[-1])
                                  for s in range(noise_draws))]
            gumbel.append(torch.stack(same).mean(0))
    return {"sampled_draft_with_q": round(torch.cat(q_rule).mean().item(), 4),
            "greedy_draft_one_hot": round(torch.cat(one_hot).mean().item(), 4),
            "seeded_gumbel_shared_noise": round(torch.cat(gumbel).mean().item(), 4)}


def main(argv: list[str] | None = None) -> int:
    from cluster.config import ModelSpec
    from replicas.engines.huggingface.loading import load_causal_lm
    from replicas.tokenizer import load_tokenizer
    from training.corpus import held_out_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="models/target")
    parser.add_argument("--draft", default="models/draft")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--noise-draws", type=int, default=64)
    args = parser.parse_args(argv)
    target, draft = load_causal_lm(ModelSpec(path=args.target)), load_causal_lm(ModelSpec(path=args.draft))
    prompts = held_out_prompts(load_tokenizer(args.target), args.prompts, 128)
    print(json.dumps({str(t): keep_rates(target, draft, prompts, t, args.noise_draws) for t in args.temperatures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
