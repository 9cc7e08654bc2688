"""The GPU checklist, one command for a lent GPU machine that has torch and transformers but
no Ray and no package registry (copy the repository there and run it from its root):

    python -m cluster.bench.gpu_check --out gpu_check.json

In order, each part timed and recorded as it ends, within --budget-s (a part that would start
after it is recorded as skipped) and a hard --deadline-s (a part running then is stopped):
0. device selection: what `device: auto` picks here, and for a replica Ray gave no GPU.
1. exactness on the device, with tiny random pairs in float32: greedy speculation on the
   engines, eager, compiled (`models.*.compile: on`) and replayed from CUDA graphs
   (`compile: auto` on a GPU), equals Hugging Face's greedy generate() of the target alone
   for k 1, 3 and 5; sampled speculation's first two tokens fit the target's exact joint
   distribution (chi-square at 0.1 %; the reference is a plain softmax of full forward
   passes, temperature 1). In bfloat16, without row blocks and with the ones a replica takes
   here (`models.target.row_block: auto`), eager and graphed: whether the target passes the
   start-up invariance probe (else replicas run it in float32), and how many greedy tokens
   of speculation differ from the engine's own single steps.
2. attention memory: the bfloat16 attention's peak over a 16 x 2,048-token prefill with an
   8 B model's heads, against its scores all at once.
3. tensor parallelism: two shards in two processes (NCCL where there are two GPUs; skipped
   where there is one; over gloo on a CPU) against the whole model in one: logits, and
   greedy tokens step by step.
4. the engine alone for random-weight Llamas of real sizes (--sizes, default 1.5b and 8b, in
   bfloat16): eager, compiled and CUDA-graphed ms per forward at 1, 8 and 32 sequences of 1
   and 5 new positions over 512 cached ones, against a plain transformers forward and the
   weight-read floor (cluster/bench/engine.py), with each size's compile time.
Exits 1 when an exactness check fails. Also runs on a CPU (--device cpu --sizes tiny) as a
smoke test of itself.
"""

from __future__ import annotations

import argparse
import json
import signal
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


def engines(target, draft, compiled: bool, row_block: int | None = None, graphs: bool = False):
    """graphs: both engines' decode and verify passes replayed from CUDA graphs (on a CPU the
    passes rerun in their buckets instead: cuda_graphs.rerun_capture)."""
    from replicas.engines.huggingface import DraftEngine, TargetEngine
    from replicas.engines.huggingface.cuda_graphs import capture_for

    pair = (DraftEngine.on_model(draft, max_cached_tokens=4000, max_seq_len=128, compiled=compiled),
            TargetEngine.on_model(target, max_cached_tokens=4000, max_seq_len=128, compiled=compiled,
                                  row_block=row_block))
    for engine in pair if graphs else ():
        engine.runner.replay_graphs(capture_for(target.device))
    return pair


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


def greedy_matches(device: torch.device, compiled: bool, max_tokens: int = 32, graphs: bool = False) -> dict:
    """Greedy speculation against the target alone, for k 1, 3, 5, on three prompts."""
    target, draft = tiny_pair(device, 64, seed=3)
    drafter, verifier = engines(target, draft, compiled, graphs=graphs)
    mismatches = [{"k": k, "prompt": i} for k in (1, 3, 5) for i, prompt in enumerate(GREEDY_PROMPTS)
                  if speculate(drafter, verifier, prompt, k, f"k{k}-{i}", max_tokens)
                  != greedy_alone(target, prompt, max_tokens)]
    described = verifier.describe()
    return {"ok": not mismatches, "mismatches": mismatches, "compile_s": described["compile_s"],
            "cuda_graphs": described["cuda_graphs"]}


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


def device_selection() -> dict:
    """What `device: auto` picks (replicas/engines/huggingface/loading.py): outside Ray any CUDA
    device; a replica Ray gave no GPU, the CPU even here."""
    from replicas.engines.huggingface.loading import pick_device

    here = str(pick_device("auto"))
    unreserved = str(pick_device("auto", reserved_gpus=[]))
    return {"ok": unreserved == "cpu" and here == ("cuda" if torch.cuda.is_available() else "cpu"),
            "auto_outside_ray": here, "auto_without_a_reserved_gpu": unreserved}


@torch.inference_mode()
def bfloat16_exactness(device: torch.device, max_tokens: int = 64) -> dict:
    """Whether a bfloat16 target's forward passes the start-up invariance probe on this device
    (invariance.py: a failing target runs in float32), and how often greedy speculation's
    tokens differ from the engine's own single steps (k 0), counted, whatever the probe said:
    without row blocks, and in the row blocks a replica takes (llama_forward.RowBlockLinear;
    on a CPU, where a replica takes none, the same block size, to run the path). What the
    replicas run decides "ok"."""
    from replicas.engines.huggingface import ROW_BLOCK

    blocked = _bfloat16_differences(device, ROW_BLOCK, max_tokens)
    graphed = _bfloat16_differences(device, ROW_BLOCK, max_tokens, graphs=True)
    return {"ok": all(run["batch_invariant"] and run["tokens_after_a_difference"] == 0 for run in (blocked, graphed)),
            "row_blocks": blocked, "row_blocks_graphed": graphed,
            "plain": _bfloat16_differences(device, None, max_tokens)}


def _bfloat16_differences(device: torch.device, row_block: int | None, max_tokens: int, graphs: bool = False) -> dict:
    from replicas.engines.huggingface.invariance import batch_invariant

    target, draft = (model.to(torch.bfloat16) for model in tiny_pair(device, 64, seed=3))
    drafter, verifier = engines(target, draft, compiled=False, row_block=row_block, graphs=graphs)
    invariant = batch_invariant(verifier.runner)
    compared = differing = 0
    for k in (1, 3, 5):
        for i, prompt in enumerate(GREEDY_PROMPTS):
            alone = speculate(drafter, verifier, prompt, 0, f"alone-{k}-{i}", max_tokens)
            speculated = speculate(drafter, verifier, prompt, k, f"k{k}-{i}", max_tokens)
            compared += len(alone)
            differing += next((len(alone) - j for j, (a, b) in enumerate(zip(alone, speculated)) if a != b), 0)
    return {"row_block": row_block, "batch_invariant": invariant, "tokens_compared": compared,
            "tokens_after_a_difference": differing}


@torch.inference_mode()
def attention_memory(device: torch.device) -> dict:
    """Peak memory of the bfloat16 attention (llama_forward._attention) over a prefill of 16 x
    2,048 tokens with an 8 B model's heads (32 query, 8 key/value, 128 wide); on a CPU 16 x
    512 of 4 heads. All its float32 scores at once would be [16, 32, 2048, 2048]: 8.6 GB."""
    from replicas.engines.huggingface.llama_forward import _attention

    rows, width, heads, kv_heads, dim = (16, 2048, 32, 8, 128) if device.type == "cuda" else (16, 512, 4, 4, 64)
    query = torch.randn(rows, heads, width, dim, device=device, dtype=torch.bfloat16)
    key, value = (torch.randn(rows, kv_heads, width, dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(rows, 1, width, width)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    started = time.perf_counter()
    _attention(query, key, value, mask, dim ** -0.5, heads // kv_heads, dim)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report = {"shape": [rows, width, heads, kv_heads, dim], "ms": round((time.perf_counter() - started) * 1000, 1),
              "all_scores_at_once_bytes": rows * heads * width * width * 4}
    if device.type == "cuda":
        report["peak_bytes_over_inputs"] = torch.cuda.max_memory_allocated(device) - base
        report["ok"] = report["peak_bytes_over_inputs"] < report["all_scores_at_once_bytes"] / 8
    return report


TP_WORLD = 2


def tensor_parallel(device: torch.device, max_tokens: int = 24) -> dict:
    """The tiny target split into two shards (tensor_parallel.shard_model, each shard its own
    ModelRunner over its own heads, all-reducing in its hooks) in two processes, against the
    whole model in this one: the logits of three prefills, then greedy steps of the three
    sequences batched. Float32 shards sum in another order: logits agree to rounding, tokens
    exactly (at these logits' margins)."""
    if device.type == "cuda" and torch.cuda.device_count() < TP_WORLD:
        return {"skipped": f"{torch.cuda.device_count()} GPU here: two shards need {TP_WORLD}"}
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_shard_process, args=(device.type, folder, max_tokens), nprocs=TP_WORLD, join=True)
        sharded = torch.load(Path(folder) / "shard0.pt")
    target, _ = tiny_pair(device, 64, seed=3)
    whole = _greedy_batch(target, device, max_tokens)
    gap = max((a - b).abs().max().item() for a, b in zip(sharded["logits"], whole["logits"], strict=True))
    return {"ok": gap < 1e-3 and sharded["tokens"] == whole["tokens"], "backend": sharded["backend"],
            "logits_max_gap": gap, "tokens_equal": sharded["tokens"] == whole["tokens"],
            "tokens_compared": sum(len(tokens) for tokens in whole["tokens"])}


def _shard_process(rank: int, device_type: str, folder: str, max_tokens: int) -> None:
    import torch.distributed as dist

    from replicas.engines.huggingface.tensor_parallel import shard_model

    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank, world_size=TP_WORLD)
    try:
        target, _ = tiny_pair(device, 64, seed=3)
        result = _greedy_batch(shard_model(target, rank, TP_WORLD), device, max_tokens)
        if rank == 0:
            torch.save({**result, "backend": backend}, Path(folder) / "shard0.pt")
    finally:
        dist.destroy_process_group()


@torch.inference_mode()
def _greedy_batch(model, device: torch.device, max_tokens: int) -> dict:
    from replicas.engines.huggingface.model_runner import ExtendCall, ModelRunner

    runner = ModelRunner(model, max_cached_tokens=4000, max_seq_len=128)
    sequences = [list(prompt) for prompt in GREEDY_PROMPTS]
    prefills = runner.extend_batch([ExtendCall(f"s{i}", tokens, 3) for i, tokens in enumerate(sequences)])
    logits = [extension.logits.cpu() for extension in prefills]
    for extension, tokens in zip(prefills, sequences):
        tokens.append(int(extension.logits[-1].argmax()))
    for _ in range(max_tokens - 1):
        for extension, tokens in zip(runner.extend_batch([ExtendCall(f"s{i}", tokens, 1)
                                                          for i, tokens in enumerate(sequences)]), sequences):
            tokens.append(int(extension.logits[-1].argmax()))
    return {"logits": logits, "tokens": [tokens[len(prompt):] for tokens, prompt in zip(sequences, GREEDY_PROMPTS)]}


def engine_figures(size: str, device: torch.device, dtype: torch.dtype, context: int, repeats: int) -> dict:
    model = random_llama(size, device, dtype)
    started = time.perf_counter()
    report = measure(model, device, [1, 8, 32], [1, 5], context, repeats, compiled=True, graphs=True)
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
    parser.add_argument("--deadline-s", type=float, default=480.0,
                        help="a part still running then is stopped and recorded as such (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    args = parser.parse_args(argv)
    device, started = torch.device(args.device), time.perf_counter()
    signal.signal(signal.SIGALRM, _over_deadline)
    signal.setitimer(signal.ITIMER_REAL, args.deadline_s)    # a hard stop: the lent machine's time is counted
    report: dict = {"device": str(device), "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "parts": {}}
    parts = [("device_selection", device_selection),
             ("greedy_eager", lambda: greedy_matches(device, compiled=False)),
             ("greedy_compiled", lambda: greedy_matches(device, compiled=True)),
             ("greedy_cuda_graphs", lambda: greedy_matches(device, compiled=False, graphs=True)),
             ("sampled_chi_square", lambda: sampled_fits(device)),
             ("bfloat16_exactness", lambda: bfloat16_exactness(device)),
             ("attention_memory", lambda: attention_memory(device)),
             ("tensor_parallel_2", lambda: tensor_parallel(device))]
    parts += [(f"engine_{size}", lambda size=size: engine_figures(size, device, getattr(torch, args.dtype),
                                                                  args.context, args.repeats)) for size in args.sizes]
    past_deadline = False
    for name, part in parts:
        if past_deadline or time.perf_counter() - started > args.budget_s:
            when = f"the {args.deadline_s:.0f} s deadline" if past_deadline else f"the {args.budget_s:.0f} s budget"
            report["parts"][name] = {"skipped": f"after {when}"}
        else:
            began = time.perf_counter()
            try:
                report["parts"][name] = {**part(), "part_s": round(time.perf_counter() - began, 1)}
            except PastDeadline:
                report["parts"][name] = {"ok": False, "error": f"stopped at the {args.deadline_s:.0f} s deadline"}
                past_deadline = True
            except Exception as exc:  # noqa: BLE001 - recorded, and the other parts still run
                report["parts"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        args.out.write_text(json.dumps(report, indent=2))      # what is done survives a cut-off
        print(f"{name}: {json.dumps(report['parts'][name])[:400]}", flush=True)
    failed = [name for name, part in report["parts"].items() if part.get("ok") is False]
    print(f"gpu_check: {'failed: ' + ', '.join(failed) if failed else 'ok'} in {time.perf_counter() - started:.0f} s "
          f"({args.out})", flush=True)
    return 1 if failed else 0


class PastDeadline(BaseException):
    """Raised in the part running at the deadline (a BaseException: a part's own handlers let it pass)."""


def _over_deadline(signum, frame) -> None:
    raise PastDeadline


if __name__ == "__main__":
    raise SystemExit(main())
