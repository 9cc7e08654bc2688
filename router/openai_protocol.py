"""OpenAI request bodies, parsed strictly from JSON: a wrong type is an error, never coerced,
and an argument we do not know is an error rather than silently ignored. Beside OpenAI's own
fields, those of vLLM's dialect that its clients send (GuideLLM, `vllm bench serve`,
lm-evaluation-harness), with vLLM's meaning."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from router.errors import bad_request
from router.tool_calls import render_call

MAX_STOP_STRINGS = 8
MAX_LOGPROBS = 20         # vLLM's default max_logprobs


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SpeculationOptions(_Body):
    enabled: bool | None = Field(None, description="False: the target alone (the baseline).")
    k: int | None = Field(None, ge=1, description="Draft tokens per round for this request.")
    method: Literal["draft_model", "ngram", "suffix", "hybrid"] | None = Field(
        None, description="Where this request's drafts come from, among the server's speculation.methods.")
    overlap: bool | None = Field(None, description="True or false: drafting of the next window during verification "
                                                   "on or off, whatever the router's auto choice (never on where the "
                                                   "server turned it off).")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM: usage so far in every chunk too.")


class JsonSchemaFormat(_Body):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON schema the output follows.")
    strict: bool | None = Field(None, description="Accepted; the output always follows the schema.")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's structured outputs: one of json, regex, choice, grammar, json_object."""
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema.")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="GBNF (llama.cpp's) or Lark.")
    json_object: bool | None = None
    disable_any_whitespace: bool = Field(True, description="False: JSON may hold whitespace between tokens "
                                                           "(vLLM's default; compact here).")


class _GenerationBody(_Body):
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1: no top-k cut.")
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, description="Independent choices per prompt.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculation: SpeculationOptions | None = None
    return_token_ids: bool = Field(False, description="vLLM extension: include the generated ids.")
    user: str | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="vLLM's: > 1 discourages repeats.")
    logit_bias: dict[str, float] | None = Field(None, description="Token id (a string) -> -100..100, added "
                                                                  "to its logit.")
    min_tokens: int = Field(0, ge=0, description="vLLM: no stop (EOS, stop ids, stop strings) before this many.")
    ignore_eos: bool = Field(False, description="vLLM: EOS does not end the output.")
    stop_token_ids: list[int] | None = Field(None, description="vLLM: token ids that end the output.")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older spelling of structured_outputs.")
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def bias_in_range(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids, not {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"the bias of token {key} must lie in [-100, 100]")
        return bias

    @field_validator("stop")
    @classmethod
    def few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return stop

    @field_validator("stream_options")
    @classmethod
    def stream_options_need_stream(cls, options: StreamOptions | None, info: ValidationInfo):
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return options

    def samples_per_prompt(self) -> int:
        """Choices sampled per prompt."""
        return self.n

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionBody(_GenerationBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    echo: bool = Field(False, description="The prompt before the completion (its tokens' logprobs too).")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Each token's logprob and this many "
                                                                          "of the most likely.")
    best_of: int | None = Field(None, ge=1, description="Sample this many per prompt and return the n "
                                                        "with the highest logprob per token.")

    @field_validator("prompt")
    @classmethod
    def some_prompt(cls, prompt):
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @field_validator("best_of")
    @classmethod
    def best_of_covers_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of is not None and best_of < n:
            raise ValueError(f"must be at least n ({n})")
        if best_of is not None and best_of > n and info.data.get("stream"):
            raise ValueError("must equal n when stream is true (the best are known only at the end)")
        return best_of

    def samples_per_prompt(self) -> int:
        """Choices sampled per prompt: best_of of them when n of the best are returned."""
        return self.best_of or self.n

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one choice (n of them) each: a list of strings or of id lists is several."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list)):
            return list(self.prompt)
        return [self.prompt]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Body):
    name: str
    arguments: str = Field(description="The call's arguments as JSON text.")


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's earlier calls.")
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")

    def text(self) -> str:
        """The message as the model sees it: its content, then any calls it made."""
        if self.content is None:
            content = ""
        else:
            content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return content + "".join(render_call(call) for call in self.tool_calls or [])


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments.")
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatBody(_GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def calls_tools(self) -> bool:
        """Whether the output is read for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @field_validator("top_logprobs")
    @classmethod
    def top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("only allowed when logprobs is true")
        return top

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


_UNION_TAGS = {"str", "int", "float", "bool", "none"}


def _param(loc: tuple[Any, ...]) -> str | None:
    """The field path of an error, without pydantic's union-member tags such as list[int]."""
    parts = [str(p) for p in loc
             if not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p or p[:1].isupper()))]
    return ".".join(parts) if parts else None


def parse_body(model: type[_Body], raw: bytes) -> Any:
    """JSON bytes -> a validated body; raise a 400 OpenAIError naming the offending field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        if error["type"] == "json_invalid":
            raise bad_request(f"Request body is not valid JSON: {error['msg']}") from None
        if error["type"] == "model_type":
            raise bad_request("Request body must be a JSON object") from None
        param = _param(error["loc"])
        if error["type"] == "extra_forbidden":
            raise bad_request(f"Unrecognized request argument supplied: {param}", param) from None
        if error["type"] == "missing":
            raise bad_request(f"Missing required parameter: '{param}'", param) from None
        message = error["msg"].removeprefix("Value error, ")
        raise bad_request(f"Invalid value for '{param}': {message}", param) from None
