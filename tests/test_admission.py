"""Admission turns OpenAI bodies into token-level generations: chat templates, limits, k."""

from __future__ import annotations

import json

import pytest

from router.admission import Admission, plain_chat_prompt
from router.errors import OpenAIError
from router.openai_protocol import ChatBody, CompletionBody, parse_body
from training.tiny_models import train_tokenizer
from tests.conftest import cluster_config

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def config(zoo):
    return cluster_config(zoo.target, zoo.drafts["perturbed"], speculation={"k": 3, "max_k": 6})


def chat_body(**fields) -> ChatBody:
    body = {"model": "specserve", "messages": [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "hi"}], **fields}
    return parse_body(ChatBody, json.dumps(body).encode())


def test_chat_without_template_uses_the_plain_one(config, tokenizer):
    assert not tokenizer.chat_template
    gen = Admission(config, tokenizer, len(tokenizer)).chat(chat_body())[0]
    assert tokenizer.decode(gen.prompt_ids) == "system: be brief\nuser: hi\nassistant:"
    assert plain_chat_prompt(chat_body().messages).endswith("assistant:")


def test_chat_uses_the_tokenizer_template_when_it_has_one(config):
    templated = train_tokenizer()
    templated.chat_template = TEMPLATE
    gen = Admission(config, templated, len(templated)).chat(chat_body())[0]
    assert templated.decode(gen.prompt_ids) == "<system>be brief</system><user>hi</user><assistant>"


def test_k_and_speculation_switch(config, tokenizer):
    admission = Admission(config, tokenizer, len(tokenizer))
    assert admission.chat(chat_body())[0].k == 3  # the config default
    assert admission.chat(chat_body(speculation={"k": 6}))[0].k == 6
    assert admission.chat(chat_body(speculation={"enabled": False, "k": 5}))[0].k == 0
    with pytest.raises(OpenAIError) as error:
        admission.chat(chat_body(speculation={"k": 7}))
    assert error.value.status == 400 and error.value.param == "speculation.k"


def test_max_tokens_default_cap_and_context_room(config, tokenizer):
    admission = Admission(config, tokenizer, len(tokenizer))
    body = parse_body(CompletionBody, b'{"model": "specserve", "prompt": [1, 2, 3]}')
    assert admission.completion(body)[0].max_tokens == config.limits.default_max_tokens
    long_prompt = list(range(1, config.limits.context_length - 4))
    body = CompletionBody(model="specserve", prompt=long_prompt, max_tokens=100)
    assert admission.completion(body)[0].max_tokens == 5  # what is left of the context


@pytest.mark.parametrize("speculation, expected", [
    (None, {"k": 3, "adaptive": True}),                  # the server chooses
    ({"k": 5}, {"k": 5, "adaptive": False}),             # the request fixes k
    ({"enabled": False}, {"k": 0, "adaptive": False}),   # or turns speculation off
])
def test_a_request_may_fix_k_or_turn_speculation_off(config, tokenizer, speculation, expected):
    body = {"model": "specserve", "prompt": "x"} | ({"speculation": speculation} if speculation else {})
    [gen] = Admission(config, tokenizer, len(tokenizer)).completion(parse_body(CompletionBody, json.dumps(body).encode()))
    assert {"k": gen.k, "adaptive": gen.adaptive} == expected


def test_a_request_cannot_turn_on_what_the_operator_turned_off(zoo, tokenizer):
    off = cluster_config(zoo.target, zoo.drafts["perturbed"], speculation={"enabled": False})
    for speculation in ({"enabled": True}, {"enabled": True, "k": 2}, {"k": 2}):
        body = json.dumps({"model": "specserve", "prompt": "x", "speculation": speculation}).encode()
        gen = Admission(off, tokenizer, len(tokenizer)).completion(parse_body(CompletionBody, body))[0]
        assert (gen.k, gen.adaptive) == (0, False), speculation


def test_a_fixed_k_must_lie_within_the_operators_bounds(zoo, tokenizer):
    bounded = cluster_config(zoo.target, zoo.drafts["perturbed"], speculation={"k": 3, "min_k": 2, "max_k": 6})
    admission = Admission(bounded, tokenizer, len(tokenizer))
    for k in (1, 7):
        body = json.dumps({"model": "specserve", "prompt": "x", "speculation": {"k": k}}).encode()
        with pytest.raises(OpenAIError) as refused:
            admission.completion(parse_body(CompletionBody, body))
        assert refused.value.status == 400 and refused.value.param == "speculation.k"


@pytest.mark.parametrize("server, asked, expected", [
    ("auto", None, "auto"), ("auto", True, True), ("auto", False, False),
    (True, None, True), (True, False, False),
    (False, None, False), (False, True, False),       # never on where the operator turned it off
])
def test_overlap_is_the_routers_choice_unless_a_request_fixes_it(zoo, tokenizer, server, asked, expected):
    config = cluster_config(zoo.target, zoo.drafts["perturbed"], speculation={"overlap": server})
    speculation = {} if asked is None else {"overlap": asked}
    body = json.dumps({"model": "specserve", "prompt": "x", "speculation": speculation}).encode()
    [gen] = Admission(config, tokenizer, len(tokenizer)).completion(parse_body(CompletionBody, body))
    assert gen.overlap == expected


def completion_body(**fields) -> CompletionBody:
    return parse_body(CompletionBody, json.dumps({"model": "specserve", "prompt": "x = 1", **fields}).encode())


def test_a_request_picks_its_draft_method_among_the_servers(zoo, tokenizer):
    both = Admission(cluster_config(zoo.target, zoo.drafts["copy"]), tokenizer, len(tokenizer))
    [gen] = both.completion(completion_body(speculation={"method": "ngram", "k": 5}))
    assert (gen.method, gen.k, gen.adaptive, gen.overlap) == ("ngram", 5, False, False)
    [gen] = both.completion(completion_body())
    assert gen.method == "draft_model" and gen.adaptive
    only_model = cluster_config(zoo.target, zoo.drafts["copy"], speculation={"methods": ["draft_model"]})
    with pytest.raises(OpenAIError) as refused:
        Admission(only_model, tokenizer, len(tokenizer)).completion(completion_body(speculation={"method": "ngram"}))
    assert refused.value.status == 400 and refused.value.param == "speculation.method"
    lookup_default = cluster_config(zoo.target, zoo.drafts["copy"], speculation={"method": "ngram"})
    [gen] = Admission(lookup_default, tokenizer, len(tokenizer)).completion(completion_body())
    assert (gen.method, gen.adaptive, gen.overlap) == ("ngram", True, False)   # lookup too: the controller's k
    off = cluster_config(zoo.target, zoo.drafts["copy"], speculation={"method": "ngram", "adaptive": False})
    [gen] = Admission(off, tokenizer, len(tokenizer)).completion(completion_body())
    assert (gen.method, gen.adaptive, gen.k) == ("ngram", False, 4)        # adaptive off: speculation.k
