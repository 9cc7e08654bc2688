"""Write the model card (README.md) of the bundled pair from what training and measurement
recorded, so that every figure in it comes from a run, with its command.

    python -m training.model_card --models models --work .cache/train
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import tempfile

import torch
from transformers import AutoConfig, LlamaForCausalLM

from cluster.config import ModelSpec
from training.acceptance import measure
from training.corpus import HELD_OUT_MODULUS, corpus_files, held_out_prompts, split
from replicas.engines.huggingface.loading import load_causal_lm
from replicas.tokenizer import load_tokenizer
from training.train_pair import (DISTILL, DRAFT, ONPOLICY, ONPOLICY_NEW, ONPOLICY_PROMPT, ONPOLICY_ROWS, SEQUENCE,
                                 TARGET)

ACCEPTANCE_COMMAND = "python -m training.acceptance --target models/target --draft models/draft"
KS = [1, 2, 4, 6, 8]


# Tokens per optimizer step of each training stage.
STAGE_TOKENS = {"target": TARGET.batch * SEQUENCE, "draft": DRAFT.batch * SEQUENCE,
                "draft-distilled": DISTILL.batch * SEQUENCE,
                "draft-onpolicy": ONPOLICY.batch * (ONPOLICY_PROMPT + ONPOLICY_NEW)}


def training_summary(models: Path, role: str, work: Path, stage_names: list[str]) -> dict:
    """Parameters, steps, tokens, wall time and losses over the stages that made a model."""
    info = json.loads((models / role / "training.json").read_text())
    stage_steps, wall = [], 0.0
    for name in stage_names:
        entries = [json.loads(line) for line in (work / name / "log.jsonl").read_text().splitlines()]
        stage_steps.append(max(e["step"] for e in entries))
        wall += (entries[-1]["time"] - entries[0]["time"]) / 60
    losses = [e["loss"] for e in entries if "loss" in e]   # the last stage's
    held_out = [e["held_out_loss"] for e in entries if "held_out_loss" in e]
    return {**info, "steps_done": sum(stage_steps), "stage_steps": stage_steps, "wall_minutes": wall,
            "tokens_seen": sum(n * STAGE_TOKENS[name] for n, name in zip(stage_steps, stage_names, strict=True)),
            "train_loss": sum(losses[-8:]) / len(losses[-8:]), "held_out_loss": held_out[-1]}


def completions(models: Path, count: int = 3, prompt_tokens: int = 96, new_tokens: int = 64) -> list[tuple[str, str]]:
    tokenizer = load_tokenizer(models / "target")
    model = load_causal_lm(ModelSpec(path=models / "target"))
    pairs = []
    for prompt in held_out_prompts(tokenizer, count, prompt_tokens):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
        pairs.append((tokenizer.decode(prompt), tokenizer.decode(out[0, len(prompt):])))
    return pairs


@torch.no_grad()
def corpus_only_draft_acceptance(models: Path, work: Path, k: int = 4) -> float:
    """Acceptance at k of the draft as it was before distillation (its corpus-stage
    checkpoint), measured the same way: the evidence for distilling."""
    model = LlamaForCausalLM(AutoConfig.from_pretrained(models / "draft", local_files_only=True))
    model.load_state_dict(torch.load(work / "draft" / "checkpoint.pt")["model"])
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        load_tokenizer(models / "draft").save_pretrained(folder)
        return measure(models / "target", Path(folder), [k], prompts=32, prompt_tokens=128, new_tokens=64)[k].acceptance


def render(target: dict, draft: dict, acceptance: dict, samples: list[tuple[str, str]],
           corpus_only_k4: float, vocab_size: int) -> str:
    train_files, held_out_files = split(corpus_files())
    rows = "\n".join(f"| {k} | {t.acceptance:.3f} | {t.tokens_per_round:.2f} |" for k, t in acceptance.items())
    shown = "\n\n".join(f"Prompt (end):\n```python\n{p[-300:]}\n```\nTarget's greedy continuation:\n"
                        f"```python\n{c}\n```" for p, c in samples)
    return f"""# specserve bundled pair: target and draft

Two Llama-architecture causal LMs (`LlamaForCausalLM`) for Python source code, trained by
specserve itself, offline, with `python -m training.train_pair --out models/`. They share one
byte-level BPE tokenizer (vocabulary {vocab_size:,}, `<|endoftext|>` as EOS) and are stored in bf16.

Why so small a vocabulary: the pair is about a thousand times smaller than the pairs people
serve. With a 4,096-token BPE (3.4 bytes per token on held-out code) the embedding took most
of a 0.6 M draft's parameters, and the first bundled pair (git history of this card) reached
0.33 acceptance at k = 4. At {vocab_size} tokens (about 2.0 bytes per token) the draft spends its
parameters on layers. The vocabulary's own effect was not isolated: the corpus-only draft
below is no better than the old one; what moved acceptance was distillation, most of all on
the target's own continuations. Tokens are shorter, so a round at the same acceptance
yields less text than with a larger vocabulary.

## Data
The standard library's own `.py` files (`sysconfig.get_paths()["stdlib"]`, site-packages
excluded) of CPython 3.11: {len(train_files)} training files, {len(held_out_files)} held out.
A file is held out when the BLAKE2b-64 hash of its path relative to the stdlib folder is 0
modulo {HELD_OUT_MODULUS} (`training/corpus.py`); held-out files are never trained on and the
tokenizer is fitted on the training files only.

## Models
| | target | draft |
|---|---|---|
| parameters | {target['parameters'] / 1e6:.2f} M | {draft['parameters'] / 1e6:.2f} M |
| shape (hidden, MLP, layers, heads) | {_shape(target)} | {_shape(draft)} |
| training steps | {target['steps_done']} | {draft['steps_done']} ({' + '.join(map(str, draft['stage_steps']))}) |
| tokens seen | {target['tokens_seen'] / 1e6:.1f} M | {draft['tokens_seen'] / 1e6:.1f} M |
| wall time (2 CPU cores, fp32) | {target['wall_minutes']:.0f} min | {draft['wall_minutes']:.0f} min |
| final training loss | {target['train_loss']:.3f} (cross-entropy) | {draft['train_loss']:.3f} (KL to the target, on its continuations) |
| held-out cross-entropy | {target['held_out_loss']:.3f} | {draft['held_out_loss']:.3f} |

Context: {target['sequence']} tokens (trained at that length; `max_position_embeddings`).
The draft is trained in three stages: on the corpus with the next-token objective (`draft`,
{draft['stage_steps'][0]} steps of {DRAFT.batch} x {SEQUENCE} tokens); distilled from the target
by minimising KL(target || draft) at every position of corpus windows (`draft-distilled`,
{draft['stage_steps'][1]} steps); then distilled the same way on the target's own greedy
continuations (`draft-onpolicy`, {draft['stage_steps'][2]} steps of {ONPOLICY.batch} rows): {ONPOLICY_ROWS}
prompts of {ONPOLICY_PROMPT} training-file tokens, each continued greedily by the target for
{ONPOLICY_NEW} tokens, the loss taken on the continuation. Corpus training alone gives a draft
that knows Python; distillation makes it agree with *this* target, which is what acceptance
measures (greedy acceptance rewards the same argmax, sampled acceptance the overlap of the
whole distributions); the last stage trains on the very kind of text greedy serving asks the
draft to predict, the target's own output, repetitions included. Measured the same way as
below, the corpus-only draft reaches {corpus_only_k4:.3f} at k = 4; the distilled one ships.

## Greedy acceptance on held-out code
`{ACCEPTANCE_COMMAND}` (32 held-out prompts of 128 tokens, 64 new tokens each):

| k | acceptance (accepted / drafted) | tokens per round |
|---|---|---|
{rows}

## Held-out completions (target, greedy)
{shown}
"""


def _shape(info: dict) -> str:
    s = info["recipe"]["shape"]
    return f"{s['hidden_size']}, {s['intermediate_size']}, {s['num_hidden_layers']}, {s['num_attention_heads']}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--work", type=Path, default=Path(".cache/train"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    acceptance = measure(args.models / "target", args.models / "draft", KS, prompts=32,
                         prompt_tokens=128, new_tokens=64)
    card = render(training_summary(args.models, "target", args.work, ["target"]),
                  training_summary(args.models, "draft", args.work, ["draft", "draft-distilled", "draft-onpolicy"]),
                  acceptance, completions(args.models), corpus_only_draft_acceptance(args.models, args.work),
                  len(load_tokenizer(args.models / "target")))
    for role in ("target", "draft"):
        (args.models / role / "README.md").write_text(card)
    print(card)


if __name__ == "__main__":
    main()
