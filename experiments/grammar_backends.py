"""llguidance against xgrammar on the bundled tokenizer: compile time per schema, mask time
per token along a valid output, and what each installs. Both are the libraries vLLM offers
for structured outputs; the one chosen is in docs/API.md ("Structured outputs").

Run where both are installed (the vLLM venv has both: docs/ENGINES.md):
    /tmp/vllm-venv/bin/python -m experiments.grammar_backends --model models/target
"""

from __future__ import annotations

import argparse
import json
import time

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False},
             {"name": "Ada", "age": 36}),
    "nested": ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
                 "required": ["id", "tags"], "additionalProperties": False},
        "ok": {"type": "boolean"}}, "required": ["user", "ok"], "additionalProperties": False},
        {"user": {"id": 7, "tags": ["a", "bc"]}, "ok": True}),
    "enum": ({"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "size": {"type": "number", "minimum": 0, "maximum": 10}},
              "required": ["colour", "size"], "additionalProperties": False},
             {"colour": "green", "size": 2.5}),
}


def _time_ms(fn, repeats: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) * 1000 / repeats


def llguidance_case(hf_tokenizer, schema: dict, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    compile_ms = _time_ms(lambda: llguidance.LLMatcher(tokenizer, grammar))
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    mask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)
    start = time.perf_counter()
    for token in tokens:
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        assert matcher.consume_token(token), matcher.get_error()
    mask_us = (time.perf_counter() - start) * 1e6 / len(tokens)
    return {"compile_ms": round(compile_ms, 2), "mask_us_per_token": round(mask_us, 1),
            "accepting": matcher.is_accepting()}


def xgrammar_case(hf_tokenizer, schema: dict, tokens: list[int]) -> dict:
    import xgrammar
    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=len(hf_tokenizer))
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    compile_ms = _time_ms(lambda: compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":")))
    matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":")))
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    start = time.perf_counter()
    for token in tokens:
        matcher.fill_next_token_bitmask(mask)
        assert matcher.accept_token(token)
    mask_us = (time.perf_counter() - start) * 1e6 / len(tokens)
    return {"compile_ms": round(compile_ms, 2), "mask_us_per_token": round(mask_us, 1),
            "accepting": matcher.is_terminated() or matcher.accept_token(info.stop_token_ids[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/target")
    args = parser.parse_args()
    from replicas.tokenizer import load_tokenizer
    hf_tokenizer = load_tokenizer(args.model)
    for name, (schema, instance) in SCHEMAS.items():
        tokens = hf_tokenizer.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
        for backend, case in (("llguidance", llguidance_case), ("xgrammar", xgrammar_case)):
            print(json.dumps({"schema": name, "backend": backend, "tokens": len(tokens),
                              **case(hf_tokenizer, schema, tokens)}))


if __name__ == "__main__":
    main()
