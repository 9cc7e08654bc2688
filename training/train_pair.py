"""Train the bundled target/draft pair on the standard library's Python sources, offline.

    python -m training.train_pair --out models/

Stages (each resumable; checkpoints in --work): fit a byte-level BPE on the training files,
encode the corpus, train the target, train the draft on the corpus, distil the draft from the
target on corpus windows, then on the target's own greedy continuations. After every checkpoint the current
weights are exported in bf16 Hugging Face format to --out/<role>, so an interrupted run still
leaves loadable models. Everything is seeded: the data order of step s depends only on
(seed, stage, s), so a resumed run sees the same batches as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from training.bpe import fit_bpe
from training.corpus import corpus_files, split

# A small vocabulary on purpose: at 4,096 tokens the 4096 x hidden embedding took most of a
# 0.6 M draft's parameters; at 512 (2.0 bytes/token on held-out code instead of 3.4) the draft
# spends them on layers. The model card says what this did and did not show.
VOCAB_SIZE = 512
SEQUENCE = 512


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int


@dataclass(frozen=True)
class Recipe:
    shape: Shape
    steps: int
    batch: int          # sequences of SEQUENCE tokens per step
    lr: float
    warmup: int = 100


# Sized by measured fp32 speed on 2 cores (bf16 autocast was 15x slower there): the target,
# 6.1 M parameters, trains at about 2,000 tokens/s; the draft, 0.63 M (a tenth), at about 10,000;
# distillation, bound by the target's forward pass, at about 3,300.
TARGET = Recipe(Shape(256, 768, 7, 4), steps=1500, batch=8, lr=1.5e-3)
DRAFT = Recipe(Shape(128, 320, 3, 4), steps=800, batch=8, lr=3e-3)
DISTILL = Recipe(DRAFT.shape, steps=900, batch=8, lr=1e-3, warmup=40)
# On-policy distillation: the target's own greedy continuations of training-file prompts,
# the text the draft must predict when serving greedy requests. Rows of ONPOLICY_PROMPT +
# ONPOLICY_NEW tokens; the loss covers the continuation only.
ONPOLICY = Recipe(DRAFT.shape, steps=1000, batch=16, lr=5e-4, warmup=20)
ONPOLICY_PROMPT, ONPOLICY_NEW, ONPOLICY_ROWS = 128, 128, 4096


def llama_config(shape: Shape, eos_id: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=SEQUENCE, tie_word_embeddings=True,
                       bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                       rope_theta=10000.0, **asdict(shape))


# ---- data -------------------------------------------------------------------------------

def prepare_tokenizer(work: Path) -> PreTrainedTokenizerFast:
    folder = work / "tokenizer"
    if (folder / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(folder)
    train_files, _ = split(corpus_files())
    tokenizer = fit_bpe((f.text() for f in train_files), VOCAB_SIZE)
    tokenizer.save_pretrained(folder)
    return tokenizer


def encode(tokenizer, files) -> torch.Tensor:
    """All files as one id stream [N] (int16), each file followed by EOS."""
    ids: list[int] = []
    for f in files:
        ids.extend(tokenizer.encode(f.text()))
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.int16)


def prepare_streams(tokenizer, work: Path) -> tuple[torch.Tensor, torch.Tensor]:
    cached = work / "streams.pt"
    if cached.is_file():
        streams = torch.load(cached)
        return streams["train"], streams["held_out"]
    train_files, held_out_files = split(corpus_files())
    train, held_out = encode(tokenizer, train_files), encode(tokenizer, held_out_files)
    torch.save({"train": train, "held_out": held_out}, cached)
    return train, held_out


def batch_at(stream: torch.Tensor, step: int, batch: int, seed: int) -> torch.Tensor:
    """Random windows [batch, SEQUENCE + 1], fixed by (seed, step)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - SEQUENCE - 1, (batch,), generator=generator)
    return torch.stack([stream[s:s + SEQUENCE + 1] for s in starts.tolist()]).long()


# ---- training ---------------------------------------------------------------------------

def learning_rate(recipe: Recipe, step: int) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def loss_on(model, windows: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on windows [B, SEQUENCE + 1]."""
    logits = model(input_ids=windows[:, :-1]).logits  # [B, SEQUENCE, V]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE), windows[:, 1:].reshape(-1))


@torch.no_grad()
def held_out_loss(model, stream: torch.Tensor, windows: int = 48) -> float:
    model.eval()
    starts = torch.linspace(0, len(stream) - SEQUENCE - 2, windows).long().tolist()
    losses = [loss_on(model, stream[s:s + SEQUENCE + 1].long()[None]).item() for s in starts]
    model.train()
    return sum(losses) / len(losses)


@dataclass(frozen=True)
class Stage:
    name: str                     # its state folder under --work
    role: str                     # exported to --out/<role>
    recipe: Recipe
    seed: int                     # model init and data order
    loss: Callable = loss_on      # (model, windows [B, SEQUENCE + 1]) -> scalar
    start_from: str | None = None  # a stage whose final weights this one starts from
    data: Callable | None = None   # (step, batch) -> windows; default: corpus windows


def distillation_loss(teacher_dir: Path, first_position: int = 0) -> Callable:
    """KL(teacher || student) per position from `first_position` on: the student learns the
    teacher's whole next-token distribution, which is what speculative acceptance rewards.
    The teacher is loaded on first use, after the target stage of the same run exported it."""
    teacher = None

    def loss(model, windows: torch.Tensor) -> torch.Tensor:
        nonlocal teacher
        if teacher is None:
            teacher = _load_teacher(teacher_dir)
        inputs = windows[:, :-1]
        with torch.no_grad():
            teacher_logp = torch.log_softmax(teacher(input_ids=inputs).logits[:, first_position:], dim=-1)
        student_logp = torch.log_softmax(model(input_ids=inputs).logits[:, first_position:], dim=-1)
        return torch.nn.functional.kl_div(student_logp.reshape(-1, VOCAB_SIZE), teacher_logp.reshape(-1, VOCAB_SIZE),
                                          log_target=True, reduction="batchmean")
    return loss


def _load_teacher(folder: Path):
    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()


@torch.no_grad()
def target_continuations(teacher_dir: Path, stream: torch.Tensor, work: Path, seed: int) -> torch.Tensor:
    """[ONPOLICY_ROWS, ONPOLICY_PROMPT + ONPOLICY_NEW]: training-stream prompts followed by
    the target's greedy continuation; generated once and cached in --work."""
    cached = work / "onpolicy.pt"
    done = torch.load(cached) if cached.is_file() else torch.empty((0, ONPOLICY_PROMPT + ONPOLICY_NEW), dtype=torch.int16)
    if len(done) >= ONPOLICY_ROWS:
        return done[:ONPOLICY_ROWS]
    teacher = _load_teacher(teacher_dir)
    generator = torch.Generator().manual_seed(seed)
    # The same seed gives the same first starts whatever ONPOLICY_ROWS is, so a cache
    # generated for fewer rows is extended, not redone.
    starts = torch.randint(0, len(stream) - ONPOLICY_PROMPT, (ONPOLICY_ROWS,), generator=generator).tolist()
    data = done
    for first in range(len(done), ONPOLICY_ROWS, 64):
        prompts = torch.stack([stream[s:s + ONPOLICY_PROMPT] for s in starts[first:first + 64]]).long()
        rows = teacher.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                max_new_tokens=ONPOLICY_NEW, min_new_tokens=ONPOLICY_NEW,
                                eos_token_id=None, pad_token_id=0)
        data = torch.cat([data, rows.to(torch.int16)])
        torch.save(data, cached)
        print(f"on-policy data: {len(data)}/{ONPOLICY_ROWS} continuations", flush=True)
    return data


def run_stage(stage: Stage, tokenizer, streams, args) -> None:
    train_stream, held_out_stream = streams
    state_dir = args.work / stage.name
    state_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(stage.seed)
    model = LlamaForCausalLM(llama_config(stage.recipe.shape, tokenizer.eos_token_id))
    optimizer = torch.optim.AdamW(model.parameters(), lr=stage.recipe.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step = _resume(state_dir, model, optimizer)
    if step == 0 and stage.start_from:
        model.load_state_dict(torch.load(args.work / stage.start_from / "checkpoint.pt")["model"])
    params = sum(p.numel() for p in model.parameters())
    print(f"{stage.name}: {params / 1e6:.2f} M parameters, steps {step}..{stage.recipe.steps}", flush=True)
    log, recipe = _Log(state_dir / "log.jsonl"), stage.recipe
    model.train()
    started, tokens = time.monotonic(), 0
    while step < recipe.steps:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(recipe, step)
        windows = stage.data(step, recipe.batch) if stage.data else batch_at(train_stream, step, recipe.batch, stage.seed)
        loss = stage.loss(model, windows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step, tokens = step + 1, tokens + recipe.batch * SEQUENCE
        if step % 25 == 0:
            log.write(step=step, loss=round(loss.item(), 4), lr=learning_rate(recipe, step),
                      tokens_per_s=round(tokens / (time.monotonic() - started)))
        if step % args.checkpoint_every == 0 or step == recipe.steps:
            log.write(step=step, held_out_loss=round(held_out_loss(model, held_out_stream), 4))
            _checkpoint(state_dir, model, optimizer, step)
            export(model, tokenizer, args.out / stage.role, stage.name, params, step, recipe)


def stages(args) -> list[Stage]:
    """The pipeline: target, draft on the corpus, the draft distilled from the target on corpus
    windows, then on the target's own greedy continuations."""
    chosen = []
    if args.stage in ("all", "target"):
        chosen.append(Stage("target", "target", TARGET, seed=args.seed * 3))
    if args.stage in ("all", "draft"):
        chosen.append(Stage("draft", "draft", DRAFT, seed=args.seed * 3 + 1))
    if args.stage in ("all", "distill"):
        chosen.append(Stage("draft-distilled", "draft", DISTILL, seed=args.seed * 3 + 2,
                            loss=distillation_loss(args.out / "target"), start_from="draft"))
    if args.stage in ("all", "onpolicy"):
        chosen.append(Stage("draft-onpolicy", "draft", ONPOLICY, seed=args.seed * 3 + 3,
                            loss=distillation_loss(args.out / "target", first_position=ONPOLICY_PROMPT - 1),
                            start_from="draft-distilled", data=_onpolicy_batches(args)))
    return chosen


def _onpolicy_batches(args) -> Callable:
    """Rows of the target's continuations, drawn by (seed, step); generated on first use."""
    rows = None

    def batches(step: int, batch: int) -> torch.Tensor:
        nonlocal rows
        if rows is None:
            tokenizer = prepare_tokenizer(args.work)
            train, _ = prepare_streams(tokenizer, args.work)
            rows = target_continuations(args.out / "target", train, args.work, seed=args.seed * 3 + 3)
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        return rows[torch.randint(0, len(rows), (batch,), generator=generator)].long()
    return batches


class _Log:
    def __init__(self, path: Path):
        self.path = path

    def write(self, **entry) -> None:
        entry["time"] = round(time.time(), 1)
        line = json.dumps(entry)
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")


def _resume(state_dir: Path, model, optimizer) -> int:
    checkpoint = state_dir / "checkpoint.pt"
    if not checkpoint.is_file():
        return 0
    state = torch.load(checkpoint)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def _checkpoint(state_dir: Path, model, optimizer, step: int) -> None:
    partial = state_dir / "checkpoint.pt.partial"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, partial)
    os.replace(partial, state_dir / "checkpoint.pt")


def export(model, tokenizer, folder: Path, stage: str, params: int, step: int, recipe: Recipe) -> None:
    """bf16 safetensors + configs + tokenizer: loadable by transformers and vLLM alike."""
    folder.mkdir(parents=True, exist_ok=True)
    copy = LlamaForCausalLM(model.config)
    copy.load_state_dict(model.state_dict())
    copy.to(torch.bfloat16).save_pretrained(folder)
    eos = tokenizer.eos_token_id
    GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, do_sample=False).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "training.json").write_text(json.dumps(
        {"stage": stage, "parameters": params, "steps_done": step, "recipe": asdict(recipe),
         "sequence": SEQUENCE}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("models"))
    parser.add_argument("--work", type=Path, default=Path(".cache/train"))
    parser.add_argument("--stage", choices=["all", "target", "draft", "distill", "onpolicy"], default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer = prepare_tokenizer(args.work)
    streams = prepare_streams(tokenizer, args.work)
    print(f"corpus: {len(streams[0]):,} training tokens, {len(streams[1]):,} held-out tokens", flush=True)
    for stage in stages(args):
        run_stage(stage, tokenizer, streams, args)


if __name__ == "__main__":
    main()
