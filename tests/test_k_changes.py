"""Output does not depend on the k and steps the controller picks: the speculation loop of a
router, on the real pools of a served app, with a controller that changes k (0, the target
alone, included) and the verify call's steps at every round. Greedy output equals Hugging Face's greedy generate(); a seeded
sampled request gives the same tokens as the same seed with the target alone."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from replicas.tokenizer import load_tokenizer
from replicas.sampling import GREEDY, SamplingParams
from router.k_control import POOL, Choice, GoodputController, Offer
from router.pool_client import PoolTimeouts
from router.speculation import Generation, SpeculationLoop, SpeculationStats
from tests.conftest import PROMPTS

SCHEDULE = ((1, 1), (5, 3), (0, 4), (3, 1), (8, 2), (2, 1), (4, 4), (0, 1), (6, 1))   # (k, steps)


class EveryRound(GoodputController):
    """A controller whose k and steps change at every round, as SCHEDULE cycles; it records
    the k it gave."""

    def __init__(self):
        super().__init__(max_k=8, min_k=0, max_steps=4)
        self.schedule, self.given = itertools.cycle(SCHEDULE), []

    def choose(self, seq_id: str, offer: Offer, context: int, cap: int, method: str = "") -> Choice:
        k, steps = next(self.schedule)
        self.given.append(k)
        k = min(k, cap)
        return Choice(POOL if k else None, k, max(1, min(steps, cap + 1 - k)), None)


def loop_on(app: str, zoo) -> tuple[SpeculationLoop, EveryRound]:
    from ray import serve

    tokenizer = load_tokenizer(zoo.target)
    control = EveryRound()
    loop = SpeculationLoop(serve.get_deployment_handle("draft", app_name=app),
                           serve.get_deployment_handle("target", app_name=app), tokenizer,
                           {tokenizer.eos_token_id}, PoolTimeouts(1.0, 60.0), control)
    return loop, control


async def generate(loop: SpeculationLoop, prompt_ids: list[int], sampling: SamplingParams, seed: int,
                   adaptive: bool = True, k: int = 4, max_tokens: int = 32) -> list[int]:
    out = []
    gen = Generation(prompt_ids, max_tokens, sampling, [], seed, k, adaptive=adaptive, seeded=True)
    async for delta in loop.run(gen, SpeculationStats()):
        out += delta.token_ids
    return out


@pytest.mark.parametrize("regime", ["perturbed", "unrelated"])
def test_greedy_output_is_the_targets_while_k_changes_every_round(apps, zoo, greedy_reference, regime):
    loop, control = loop_on(f"spec-{regime}", zoo)
    tokenizer = load_tokenizer(zoo.target)

    async def all_prompts():
        return [await generate(loop, tokenizer.encode(prompt), GREEDY, 0) for prompt in PROMPTS[:4]]
    for prompt, got in zip(PROMPTS[:4], asyncio.run(all_prompts())):
        assert got == greedy_reference(prompt, 32)
    rounds = len(control.given)
    assert set(control.given) == {k for k, _ in SCHEDULE} and rounds >= 4 * 32 / 8   # every k, many rounds


def test_a_seeded_sample_is_the_same_while_k_changes_every_round(apps, zoo):
    loop, _ = loop_on("spec-perturbed", zoo)
    tokenizer = load_tokenizer(zoo.target)
    sampling = SamplingParams(temperature=0.8, top_p=0.9)

    async def samples(ids):
        return [await generate(loop, ids, sampling, seed=77, adaptive=False, k=0),
                await generate(loop, ids, sampling, seed=77), await generate(loop, ids, sampling, seed=78)]
    for prompt in PROMPTS[:3]:
        alone, changing, other_seed = asyncio.run(samples(tokenizer.encode(prompt)))
        assert changing == alone and other_seed != alone
