"""A simulated cluster for the goodput controller (router/k_control.py): the router's
sequences round together in batches, each round's time made of coordination, the draft
pool's passes and the target's passes on a hardware model, with lognormal noise; each
sequence keeps each draft with its own chance, once the drafts before it were kept.

Two hardware models, as the issue names them: compute-bound (a CPU: a pass costs in
proportion to its positions) and memory-bound (a large target on a GPU: a verify of k + 1
positions costs about one step)."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field

from router.k_control import POOL, GoodputController, Offer


@dataclass
class Hardware:
    target_fixed_ms: float
    target_per_row_ms: float
    target_per_position_ms: float
    draft_fixed_ms: float
    draft_per_row_ms: float
    coordination_ms: float          # a round without a draft call
    draft_hop_ms: float             # what a draft call adds to it
    # what each draft in flight adds to a round outside every pass (transport, the router's
    # work, contention for the cores): no pass reports it, only the rounds' times show it
    hidden_per_draft_ms: float = 0.0

    def target_ms(self, rows: int, positions: int) -> float:
        return self.target_fixed_ms + self.target_per_row_ms * rows + self.target_per_position_ms * positions

    def draft_ms(self, rows: int) -> float:
        return self.draft_fixed_ms + self.draft_per_row_ms * rows


def compute_bound() -> Hardware:
    """Near the default cluster on this 2-core CPU (the fused forward): a step of one row
    about 2 ms, of 8 rows about 5 ms, a verify of 5 positions over 8 rows 2.25x a step."""
    return Hardware(target_fixed_ms=1.0, target_per_row_ms=0.25, target_per_position_ms=0.28,
                    draft_fixed_ms=0.4, draft_per_row_ms=0.05, coordination_ms=3.0, draft_hop_ms=2.0)


def memory_bound() -> Hardware:
    """A large target on a GPU: a pass costs its weight reads, about the same for 1 or 80 positions."""
    return Hardware(target_fixed_ms=25.0, target_per_row_ms=0.02, target_per_position_ms=0.01,
                    draft_fixed_ms=1.5, draft_per_row_ms=0.01, coordination_ms=1.0, draft_hop_ms=1.0)


@dataclass
class SimSequence:
    seq_id: str
    keep: float                     # chance of each draft, once those before it were kept
    method: str = "draft_model"     # or "ngram": lookup drafts offered, `lookup_len` of them
    lookup_len: int = 8
    context: int = 128
    sampled: bool = False           # its chances pool with the other sampled sequences'


@dataclass
class Simulation:
    hardware: Hardware
    sequences: list[SimSequence]
    noise: float = 0.2
    max_k: int = 8
    max_steps: int = 4
    seed: int = 0
    controller: GoodputController = field(init=False)
    history: list[dict[str, tuple[str | None, int, int]]] = field(default_factory=list)   # per round: seq -> choice

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.controller = GoodputController(self.max_k, 0, self.max_steps)
        self._batches = itertools.count()
        # what the replicas time at start (replicas/engines/huggingface/timing.py STARTUP_SHAPES),
        # each the median of three passes: about half the noise of one
        shapes = ((1, 1), (1, 4), (2, 2), (2, 6), (4, 4))
        self.controller.anchor("target", [(r, p, 0.0, self._noisy(self.hardware.target_ms(r, p), 0.5))
                                          for r, p in shapes])
        self.controller.anchor("draft", [(r, p, 0.0, self._noisy(self.hardware.draft_ms(r), 0.5)) for r, p in shapes])
        for seq in self.sequences:
            self.controller.begin(seq.seq_id, seq.sampled)

    def set_sequences(self, sequences: list[SimSequence]) -> None:
        for seq in self.sequences:
            self.controller.end(seq.seq_id)
        self.sequences = sequences
        for seq in sequences:
            self.controller.begin(seq.seq_id, seq.sampled)

    def _noisy(self, ms: float, share: float = 1.0) -> float:
        noise = self.noise * share
        return ms * math.exp(self.rng.gauss(0, noise) - noise ** 2 / 2)

    def _offer(self, seq: SimSequence) -> Offer:
        if seq.method == "ngram":
            return Offer(tuple(range(seq.lookup_len)), "ngram", 3) if seq.lookup_len else Offer()
        return Offer(pool=True)

    def round(self) -> dict:
        """One batch round of every sequence; what each chose and what the round yielded."""
        choices = {seq.seq_id: self.controller.choose(seq.seq_id, self._offer(seq), seq.context, 1000, seq.method)
                   for seq in self.sequences}
        rows = len(self.sequences)
        steps = max(c.steps for c in choices.values())
        pool_ks = [c.k for c in choices.values() if c.source == POOL and c.k]
        draft_passes = [(n, n, 0.0, self._noisy(self.hardware.draft_ms(n)))
                        for s in range(1, max(pool_ks, default=0) + 1) for n in [sum(k >= s for k in pool_ks)]]
        positions = sum(c.k + 1 for c in choices.values())
        target_passes = [(rows, positions, 0.0, self._noisy(self.hardware.target_ms(rows, positions)))]
        target_passes += [(rows, rows, 0.0, self._noisy(self.hardware.target_ms(rows, rows))) for _ in range(steps - 1)]
        draft_call = bool(pool_ks)
        coordination = self._noisy(self.hardware.coordination_ms + (self.hardware.draft_hop_ms if draft_call else 0)
                                   + self.hardware.hidden_per_draft_ms * sum(c.k for c in choices.values()))
        engine = sum(p[3] for p in target_passes) + sum(p[3] for p in draft_passes)
        wall = coordination + engine
        batch = str(next(self._batches))
        self.controller.observe_passes("target", "t" + batch, target_passes)
        if draft_passes:
            self.controller.observe_passes("draft", "d" + batch, draft_passes)
        tokens = 0
        for seq in self.sequences:
            choice = choices[seq.seq_id]
            kept = 0
            while kept < choice.k and self.rng.random() < seq.keep:
                kept += 1
            tokens += kept + 1 + steps - 1
            self.controller.observe_round(seq.seq_id, choice.source if choice.k else None, choice.k, kept,
                                          3 if choice.source == "ngram" else 0)
            self.controller.observe_timing(draft_call, wall, engine, choice.predicted_ms)
        self.history.append({seq_id: (c.source, c.k, c.steps) for seq_id, c in choices.items()})
        return {"tokens": tokens, "ms": wall}

    def run(self, rounds: int) -> list[dict]:
        return [self.round() for _ in range(rounds)]

    def ks(self, seq_id: str, last: int) -> list[int]:
        return [round_[seq_id][1] for round_ in self.history[-last:]]


def expected_goodput(hardware: Hardware, keeps: list[float], ks: list[int], steps: int,
                     pool: bool = True) -> float:
    """Tokens per ms of a batch where sequence i keeps each draft with keeps[i] and drafts ks[i]."""
    rows = len(keeps)
    tokens = sum(sum(keep ** j for j in range(k + 1)) + steps - 1 for keep, k in zip(keeps, ks))
    draft_call = pool and any(ks)
    draft = sum(hardware.draft_ms(sum(k >= s for k in ks)) for s in range(1, max(ks) + 1)) if draft_call else 0.0
    ms = (hardware.coordination_ms + (hardware.draft_hop_ms if draft_call else 0.0) + draft
          + hardware.hidden_per_draft_ms * sum(ks)
          + hardware.target_ms(rows, sum(k + 1 for k in ks)) + (steps - 1) * hardware.target_ms(rows, rows))
    return tokens / ms


def best_uniform(hardware: Hardware, keep: float, rows: int, max_k: int = 8, max_steps: int = 4,
                 pool: bool = True) -> tuple[int, int, float]:
    """The best (k, steps) for `rows` sequences that all keep drafts with `keep`, and its goodput."""
    return max(((k, s, expected_goodput(hardware, [keep] * rows, [k] * rows, s, pool))
                for k in range(max_k + 1) for s in range(1, max_steps + 1)), key=lambda t: t[2])
