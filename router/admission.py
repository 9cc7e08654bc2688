"""From a parsed OpenAI body to a Generation: tokenise, check the limits of this cluster,
choose k. Everything that can be wrong with a request is found here, before any model work.

Sizes are checked before the tokenizer runs: no token is longer than the tokenizer's longest
vocabulary entry, so a text longer than context_length of those cannot fit the context and
is refused without being tokenised (a 50 MB prompt would otherwise cost minutes of CPU).
The router calls these methods off its event loop (tokenising and templating are CPU work).
"""

from __future__ import annotations

import secrets

from cluster.config import ClusterConfig
from replicas.sampling import SAMPLING_EPS, SamplingParams
from router.errors import bad_request, model_not_found
from router.openai_protocol import ChatBody, ChatMessage, CompletionBody, _GenerationBody
from router.speculation import Generation

# Used when the tokenizer has no chat template of its own.
PLAIN_CHAT_TEMPLATE_DOC = "each message as '<role>: <content>\\n', then 'assistant:'"


def plain_chat_prompt(messages: list[ChatMessage]) -> str:
    return "".join(f"{m.role}: {m.text()}\n" for m in messages) + "assistant:"


def longest_token_chars(tokenizer) -> int:
    """The most characters one token can stand for: its vocabulary entry's length (byte-level
    entries spell one character per byte; added tokens are matched as their whole text)."""
    return max(len(entry) for entry in tokenizer.get_vocab())


class Admission:
    def __init__(self, config: ClusterConfig, tokenizer, vocab_size: int):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_prompt_chars = config.limits.context_length * longest_token_chars(tokenizer)

    def completion(self, body: CompletionBody) -> Generation:
        self._check_model(body.model)
        self._check_sizes(body, len(body.prompt) if isinstance(body.prompt, str) else 0, "prompt")
        if isinstance(body.prompt, str):
            prompt_ids = self.tokenizer.encode(body.prompt)
        else:
            prompt_ids = self._checked_ids(body.prompt)
        return self._generation(body, prompt_ids, body.max_tokens, "prompt")

    def chat(self, body: ChatBody) -> Generation:
        self._check_model(body.model)
        self._check_sizes(body, sum(len(m.text()) for m in body.messages), "messages")
        if self.tokenizer.chat_template:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            prompt = plain_chat_prompt(body.messages)
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        max_param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        return self._generation(body, prompt_ids, body.requested_max_tokens(), "messages", max_param)

    def _check_model(self, name: str) -> None:
        if name != self.config.server.model_name:
            raise model_not_found(name)

    def _check_sizes(self, body: _GenerationBody, prompt_chars: int, prompt_param: str) -> None:
        longest_stop = self.config.limits.max_stop_chars
        if any(len(stop) > longest_stop for stop in body.stop_strings()):
            raise bad_request(f"A stop string is at most {longest_stop} characters on this server.", "stop")
        if prompt_chars > self.max_prompt_chars:
            raise bad_request(
                f"This model's maximum context length is {self.config.limits.context_length} tokens; "
                f"the prompt has {prompt_chars} characters, more than that many tokens can hold.", prompt_param)

    def _checked_ids(self, ids: list[int]) -> list[int]:
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise bad_request(f"prompt token ids must lie in [0, {self.vocab_size})", "prompt")
        return ids

    def _generation(self, body: _GenerationBody, prompt_ids: list[int], max_tokens: int | None,
                    prompt_param: str, max_param: str = "max_tokens") -> Generation:
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
        return Generation(
            prompt_ids=list(prompt_ids),
            max_tokens=min(wanted, room),
            sampling=_sampling(body),
            stop=body.stop_strings(),
            seed=body.seed if body.seed is not None else secrets.randbits(63),
            seeded=body.seed is not None,
            **self._k(body),
        )

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
        if not (spec.enabled and wanted):
            return {"k": 0, "adaptive": False, "overlap": False}
        asked = options.overlap if options is not None else None
        overlap = spec.overlap if asked is None or spec.overlap is False else asked
        return {"k": fixed or spec.k, "adaptive": spec.adaptive and fixed is None, "overlap": overlap}


def _sampling(body: _GenerationBody) -> SamplingParams:
    # A temperature too small to divide logits by safely is greedy (as in vLLM).
    temperature = 0.0 if body.temperature < SAMPLING_EPS else body.temperature
    return SamplingParams(temperature, body.top_p, max(body.top_k, 0))
