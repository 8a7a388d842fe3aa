"""The OpenAI request parsing and the Prometheus text, without a server (milliseconds)."""

from __future__ import annotations

import pytest

from spade.errors import ArgumentError, ConfigError
from spade.serving import openai_protocol as oai
from spade.serving.metrics import Histogram, ServerMetrics, engine_value
from spade.serving.params import RequestOutput


def _params(body: dict, kind=oai.CompletionRequest, default=16):
    return oai.to_sampling_params(oai.parse_request(kind, body), default_max_tokens=default)


def _refused(body: dict, kind=oai.CompletionRequest) -> oai.APIError:
    with pytest.raises(oai.APIError) as e:
        _params(body, kind)
    assert e.value.status == 400 and e.value.body()["error"]["type"] == "invalid_request_error"
    return e.value


def test_sampling_fields_map_to_sampling_params():
    p = _params({"prompt": "x", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 3,
                 "stop": "\n", "stop_token_ids": [5], "ignore_eos": True, "user": "u", "extra": {"a": 1}})
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.stop_token_ids, p.ignore_eos) == \
        (7, 0.5, 0.9, 40, 3, ["\n"], [5], True)
    assert _params({"prompt": "x"}, default=16).max_tokens == 16 and _params({"prompt": "x"}).greedy
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert _params({**chat, "max_completion_tokens": 5, "max_tokens": 9}, oai.ChatCompletionRequest).max_tokens == 5


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -7}, "top_k"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "n": 3}, "n"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
])
def test_refusals_name_the_field(body, param):
    e = _refused(body)
    assert e.param == param and e.message.startswith(param), e.message


def test_chat_refusals_and_messages():
    assert _refused({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
                    oai.ChatCompletionRequest).param == "max_completion_tokens"
    assert _refused({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
                    oai.ChatCompletionRequest).param == "tools"
    assert _refused({"messages": "hi"}, oai.ChatCompletionRequest).param == "messages"
    req = oai.parse_request(oai.ChatCompletionRequest, {"messages": []})
    with pytest.raises(oai.APIError, match="messages: the list is empty"):
        oai.chat_messages(req)
    req = oai.parse_request(oai.ChatCompletionRequest, {"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    msgs = oai.chat_messages(req)
    assert msgs == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert oai.plain_chat_prompt(msgs) == "system: be brief\nuser: ab\nassistant:"
    req = oai.parse_request(oai.ChatCompletionRequest, {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(oai.APIError, match=r"messages\[0\].content\[0\]: only text parts"):
        oai.chat_messages(req)


def test_union_fields_say_what_they_take():
    assert _refused({"prompt": 5}).message == \
        "prompt: expected a string, a list of token ids, or a list holding one of those, got int"
    assert _refused({"prompt": "x", "stop": 3}).message == "stop: expected a string or a list of strings, got int"
    e = _refused({"messages": [{"role": "user", "content": 5}]}, oai.ChatCompletionRequest)
    assert e.param == "messages" and e.message.startswith("messages[0].content: expected a string or a list")


def test_body_must_be_an_object():
    with pytest.raises(oai.APIError) as e:
        oai.parse_request(oai.CompletionRequest, [1, 2])
    assert e.value.param == "body"


def test_engine_errors_become_400_naming_the_field():
    e = oai.engine_error(ArgumentError("SamplingParams.max_tokens: the prompt has 9 tokens and ..."))
    assert (e.status, e.param) == (400, "max_tokens")
    assert oai.engine_error(ArgumentError("prompt[3]: token id 9999 is outside the vocabulary")).param == "prompt"
    assert oai.engine_error(ConfigError("model.max_seq_len (64) is too small")).param == "max_tokens"


def test_response_builders():
    out = RequestOutput("r", [1, 2, 3], [4, 5], "ab", "b", "length")
    r = oai.completion_response("cmpl-1", "m", 7, out)
    assert r["choices"][0]["text"] == "ab" and r["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                                              "total_tokens": 5}
    c = oai.chat_response("chatcmpl-1", "m", 7, out)
    assert c["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    u = oai.usage_chunk("chatcmpl-1", "m", 7, "chat.completion.chunk", out)
    assert u["choices"] == [] and u["usage"]["total_tokens"] == 5


def test_histogram_buckets_are_cumulative():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0, float("nan")):
        h.observe(v)
    lines = h.lines("x", {"a": "b"})
    assert lines == ['x_bucket{a="b",le="0.1"} 2', 'x_bucket{a="b",le="1.0"} 3', 'x_bucket{a="b",le="+Inf"} 4',
                     'x_sum{a="b"} 3.65', 'x_count{a="b"} 4']


def test_metrics_render_engine_series_and_labels():
    m = ServerMetrics({"model": 'q"1', "policy": "full", "topology": "inline", "transport": "local"})
    m.finish("length", ttft=0.01, tpot=0.002, e2e=0.05, queue=0.0, prompt_tokens=5, completion_tokens=3)
    m.reject("overload")
    text = m.render({"requests_running": 2, "requests_waiting": 1, "slots_used": 2, "slots_free": 6,
                     "tokens_generated": 10, "late_packs": 0, "topk_fallbacks": None})
    lab = 'model="q\\"1",policy="full",topology="inline",transport="local"'
    for line in (f"spade_num_requests_running{{{lab}}} 2", f"spade_num_requests_waiting{{{lab}}} 1",
                 f"spade_slots_free{{{lab}}} 6", f"spade_generation_tokens_total{{{lab}}} 10",
                 f"spade_topk_fallbacks_total{{{lab}}} 0", f"spade_completion_tokens_total{{{lab}}} 3",
                 f'spade_request_finished_total{{{lab},finish_reason="length"}} 1',
                 f'spade_request_rejected_total{{{lab},reason="overload"}} 1',
                 f"spade_time_to_first_token_seconds_count{{{lab}}} 1"):
        assert line in text.splitlines(), line
    assert "spade_kv_blocks_used" not in text  # not reported by the engine: left out
    assert engine_value({"requests_running": 4}, "running") == 4 and engine_value({}, "running") is None
