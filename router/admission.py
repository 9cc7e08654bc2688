"""From a parsed OpenAI body to its Generations, one per choice (n per prompt): tokenise,
check the limits of this cluster, choose k. Everything that can be wrong with a request is
found here, before any model work.

Sizes are checked before the tokenizer runs: no token is longer than the tokenizer's longest
vocabulary entry, so a text longer than context_length of those cannot fit the context and
is refused without being tokenised (a 50 MB prompt would otherwise cost minutes of CPU).
The router calls these methods off its event loop (tokenising and templating are CPU work).
"""

from __future__ import annotations

import hashlib
import secrets

from cluster.config import ClusterConfig
from replicas.sampling import SAMPLING_EPS, SamplingParams
from router.errors import bad_request, model_not_found
from router.openai_protocol import ChatBody, ChatMessage, CompletionBody, _GenerationBody
from router.speculation import Generation
from router.structured_outputs import GrammarCompiler
from router.tool_calls import render_tools

# Used when the tokenizer has no chat template of its own.
PLAIN_CHAT_TEMPLATE_DOC = "each message as '<role>: <content>\\n', then 'assistant:'"


def plain_chat_prompt(messages: list[ChatMessage]) -> str:
    return "".join(f"{m.role}: {m.text()}\n" for m in messages) + "assistant:"


def longest_token_chars(tokenizer) -> int:
    """The most characters one token can stand for: its vocabulary entry's length (byte-level
    entries spell one character per byte; added tokens are matched as their whole text)."""
    return max(len(entry) for entry in tokenizer.get_vocab())


def choice_seed(seed: int, choice: int) -> int:
    """The seed of a request's choice: its own for the first, an independent one derived from
    it for each other (seeded choices are sampled by Gumbel-max noise keyed by the seed, so
    choices sharing one would be the same)."""
    if choice == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:choice:{choice}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Admission:
    def __init__(self, config: ClusterConfig, tokenizer, vocab_size: int, eos_token_ids: set[int] = frozenset()):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.max_prompt_chars = config.limits.context_length * longest_token_chars(tokenizer)
        self.grammars = GrammarCompiler(tokenizer, config.limits.max_grammar_chars)

    def completion(self, body: CompletionBody) -> list[Generation]:
        """A Generation per choice, prompt by prompt, n each (the order of the choices' index)."""
        self._check_model(body.model)
        prompts = body.prompts()
        samples = body.samples_per_prompt()
        self._check_choices(samples, len(prompts), "best_of" if samples > body.n else "n")
        self._check_sizes(body, max(len(p) if isinstance(p, str) else 0 for p in prompts), "prompt")
        # best_of ranks its samples by their tokens' logprobs: asked for or not, they are computed
        ranked_logprobs = body.logprobs if body.logprobs is not None or samples == body.n else 0
        generations = []
        for prompt in prompts:
            if isinstance(prompt, str):
                prompt_ids = self.tokenizer.encode(prompt)
            else:
                prompt_ids = list(self._token_ids(prompt, "prompt"))
            echo = (prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)) if body.echo else None
            generations += self._generations(body, prompt_ids, body.max_tokens, "prompt", logprobs=ranked_logprobs,
                                             prompt_logprobs=body.logprobs if body.echo else None, echo=echo,
                                             choices=samples)
        return generations

    def chat(self, body: ChatBody) -> list[Generation]:
        self._check_model(body.model)
        self._check_choices(body.n, 1)
        self._check_sizes(body, sum(len(m.text()) for m in body.messages), "messages")
        if self.tokenizer.chat_template:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
            prompt = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                        add_generation_prompt=True)
        else:
            prompt = (render_tools(body.tools) if body.tools else "") + plain_chat_prompt(body.messages)
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        max_param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        return self._generations(body, prompt_ids, body.requested_max_tokens(), "messages", max_param,
                                 logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                                 tools=self.grammars.tools(body))

    def _check_model(self, name: str) -> None:
        if name != self.config.server.model_name:
            raise model_not_found(name)

    def _check_choices(self, n: int, prompts: int, param: str = "n") -> None:
        most = self.config.limits.max_choices
        if n > most:
            raise bad_request(f"{param} is at most {most} on this server.", param)
        if n * prompts > most:
            raise bad_request(f"{prompts} prompts of {param}={n} choices each are {n * prompts} choices; this "
                              f"server gives at most {most} a request.", "prompt")

    def _token_ids(self, ids: list[int], param: str) -> tuple[int, ...]:
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise bad_request(f"{param} must hold token ids in [0, {self.vocab_size})", param)
        return tuple(ids)

    def _check_sizes(self, body: _GenerationBody, prompt_chars: int, prompt_param: str) -> None:
        longest_stop = self.config.limits.max_stop_chars
        if any(len(stop) > longest_stop for stop in body.stop_strings()):
            raise bad_request(f"A stop string is at most {longest_stop} characters on this server.", "stop")
        if prompt_chars > self.max_prompt_chars:
            raise bad_request(
                f"This model's maximum context length is {self.config.limits.context_length} tokens; "
                f"the prompt has {prompt_chars} characters, more than that many tokens can hold.", prompt_param)

    def _generations(self, body: _GenerationBody, prompt_ids: list[int], max_tokens: int | None,
                     prompt_param: str, max_param: str = "max_tokens", logprobs: int | None = None,
                     prompt_logprobs: int | None = None, echo: str | None = None,
                     choices: int | None = None, tools: str | None = None) -> list[Generation]:
        """tools: the grammar of a chat request's tool choice (router/tool_calls.py)."""
        limits = self.config.limits
        if not prompt_ids:
            raise bad_request("The prompt is empty.", prompt_param)
        room = limits.context_length - len(prompt_ids)
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {limits.context_length} tokens; the prompt "
                f"has {len(prompt_ids)}, leaving no room for a completion.", prompt_param)
        if max_tokens is not None and max_tokens > limits.max_tokens:
            raise bad_request(f"{max_param} is at most {limits.max_tokens} on this server.", max_param)
        wanted = max_tokens if max_tokens is not None else limits.default_max_tokens
        stop_ids = self._token_ids(body.stop_token_ids or [], "stop_token_ids")
        bias = tuple((int(token), value) for token, value in (body.logit_bias or {}).items())
        self._token_ids([token for token, _ in bias], "logit_bias")
        if bias and self.config.pools.target.engine == "vllm":
            raise bad_request("logit_bias is not served with the vLLM target engine: vLLM 0.32 refuses it under "
                              "speculative decoding.", "logit_bias")
        grammar = self.grammars.grammar(body)
        if grammar is not None and tools is not None:
            raise bad_request("A request with a tool choice takes no other output constraint; use tool_choice "
                              "'none' or drop the constraint.", "tool_choice")
        grammar = grammar or tools
        ends = set(stop_ids) | (set() if body.ignore_eos else self.eos_token_ids)
        sampling = _sampling(body, bias, tuple(sorted(ends)), grammar)
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        return [Generation(
            prompt_ids=list(prompt_ids),
            max_tokens=min(wanted, room),
            sampling=sampling,
            stop=body.stop_strings(),
            seed=choice_seed(seed, choice),
            seeded=body.seed is not None,
            stop_token_ids=stop_ids,
            ignore_eos=body.ignore_eos,
            include_stop=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            echo=echo,
            **self._k(body),
        ) for choice in range(choices or body.n)]

    def _k(self, body: _GenerationBody) -> dict:
        """k and whether to adapt it. A request may turn speculation off or fix k within the
        operator's bounds, but cannot turn on what the operator turned off."""
        spec = self.config.speculation
        options = body.speculation
        wanted = options.enabled if options is not None and options.enabled is not None else True
        fixed = options.k if options is not None else None
        if fixed is not None and not max(1, spec.min_k) <= fixed <= spec.max_k:
            raise bad_request(f"speculation.k must lie in [{max(1, spec.min_k)}, {spec.max_k}] on this server.",
                              "speculation.k")
        method = (options.method if options is not None else None) or spec.method
        if method not in spec.methods:
            raise bad_request(f"speculation.method {method!r} is not served here; this server's methods: "
                              f"{', '.join(spec.methods)}.", "speculation.method")
        if method != spec.method and self.config.pools.target.engine == "vllm":
            raise bad_request(f"speculation.method {method!r} is not served with the vLLM target engine, "
                              f"which drafts by {spec.method} alone.", "speculation.method")
        if not (spec.enabled and wanted):
            return {"k": 0, "adaptive": False, "overlap": False}
        if method in ("ngram", "suffix"):   # free drafts: nothing to draft ahead
            return {"k": fixed or spec.k, "adaptive": spec.adaptive and fixed is None, "overlap": False,
                    "method": method}
        asked = options.overlap if options is not None else None
        overlap = spec.overlap if asked is None or spec.overlap is False else asked
        return {"k": fixed or spec.k, "adaptive": spec.adaptive and fixed is None, "overlap": overlap, "method": method}


def _sampling(body: _GenerationBody, bias: tuple[tuple[int, float], ...], ends: tuple[int, ...],
              grammar: str | None) -> SamplingParams:
    # A temperature too small to divide logits by safely is greedy (as in vLLM).
    temperature = 0.0 if body.temperature < SAMPLING_EPS else body.temperature
    return SamplingParams(temperature, body.top_p, max(body.top_k, 0),
                          presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                          repetition_penalty=body.repetition_penalty, logit_bias=bias,
                          min_tokens=body.min_tokens, stop_ids=ends if body.min_tokens else (), grammar=grammar)
