"""``spade serve`` driven by real clients: the official ``openai`` SDK (sync and async)
and raw HTTP, against a live server (a subprocess on 127.0.0.1) over the real
``AsyncEngine`` on CPU: SmolLM2-135M (fast backend, fp32) with the asyncspade policy
and short prompts; the tiny random-weight preset where only tokens count (overload,
shutdown)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import pytest

from tests.serving.live import LiveServer, alive, children, http_module, metric

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

KEY = "test-key-123"
MODEL = "smollm2-135m"
# sparse from the 33rd token on: most requests below decode sparsely
SMOL = f"""
model: {{name: {MODEL}, backend: fast, dtype: float32, device: cpu, max_seq_len: 384}}
policy: {{name: asyncspade, budget: 32, sink_tokens: 4, recent_tokens: 8, predictor: last, window: 4}}
runtime: {{topology: inline}}
serving: {{max_batch: 4}}
serve: {{api_key: {KEY}, max_waiting: 64, shutdown_grace_s: 2, default_max_tokens: 3, request_timeout_s: 5}}
"""

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Once upon a time, in a small village by the river, there lived",
    "def fibonacci(n):",
    "Translate to French: good morning",
    "The quick brown fox",
    "Why is the sky blue? Answer in one sentence.",
]


@pytest.fixture(scope="module")
def http():
    return http_module()


def _live(tmp_path_factory, name: str, config: str):
    s = LiveServer(tmp_path_factory.mktemp(name), config)
    yield s
    rc = s.stop()
    assert rc == 0, f"spade serve exited {rc}:\n{s.log()}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from _live(tmp_path_factory, "serve", SMOL)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base, api_key=KEY, max_retries=0, timeout=120)


def _metrics(http, server) -> str:
    r = http.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200
    return r.text


# --------------------------------------------------------------------------- the openai SDK
def test_models_and_health(server, client, http):
    r = http.get(server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    meta = models.data[0].model_extra["spade"]
    assert meta["policy"] == "asyncspade" and meta["budget"] == 32
    assert meta["topology"] == "inline" and meta["transport"] == "local"
    assert meta["max_batch"] == 4 and meta["prefill_chunk"] >= 0


def test_completion_sync_stream_equals_nonstream(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason in ("length", "stop") and c.text
    u = r.usage
    assert u.completion_tokens == 6 or c.finish_reason == "stop"
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and u.prompt_tokens > 0
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == c.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == c.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == u.model_dump()


def test_chat_sync_stream_equals_nonstream(client):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPTS[7]}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
    m = r.choices[0].message
    assert r.object == "chat.completion" and m.role == "assistant" and m.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == m.content
    assert chunks[-1].usage.model_dump() == r.usage.model_dump()
    assert r.usage.completion_tokens == 5 or r.choices[0].finish_reason == "stop"


def test_default_max_tokens(client):
    """A request without max_tokens gets serve.default_max_tokens (3 here)."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[4]}],
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = client.completions.create(model=MODEL, prompt=PROMPTS[4], temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


TINY_AS = """
model: {name: tiny, dtype: float32, device: cpu, max_seq_len: 160}
policy: {name: asyncspade, budget: 12, sink_tokens: 2, recent_tokens: 4, window: 4}
runtime: {topology: inline, sparse_threshold: 16}
serving: {max_batch: 4}
serve: {max_waiting: 64, shutdown_grace_s: 5}
"""


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    yield from _live(tmp_path_factory, "serve_tiny", TINY_AS)


def test_async_sdk_16_concurrent_equal_alone(tiny_server, http):
    """16 requests of different prompts and lengths at once (four times what the batch
    holds: most wait, rows join and leave a running batch that decodes sparsely), each
    one's greedy tokens equal to the same request alone; the usage counts add up, per
    request and in /metrics. The tiny preset reads text as bytes and writes token ids."""
    server = tiny_server
    client = openai.AsyncOpenAI(base_url=server.base, api_key="none", max_retries=0, timeout=300)
    reqs = [(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), 3 + (5 * i) % 19, i % 3 == 0)
            for i in range(16)]

    async def one(prompt, n, stream):
        kw = dict(model="tiny", prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
        if not stream:
            r = await client.completions.create(**kw)
            return r.choices[0].text, r.usage.model_dump()
        text, usage = "", None
        async for ch in await client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            if ch.choices:
                text += ch.choices[0].text
            if ch.usage is not None:
                usage = ch.usage.model_dump()
        return text, usage

    async def main():
        alone = [await one(p, n, False) for p, n, _ in reqs]  # one at a time
        before = _metrics(http, server)
        together = await asyncio.gather(*(one(p, n, s) for p, n, s in reqs))
        await client.close()
        return alone, before, together

    alone, before, together = asyncio.run(main())
    after = _metrics(http, server)
    for i, ((ta, ua), (tt, ut)) in enumerate(zip(alone, together)):
        assert tt == ta, f"request {i} ({reqs[i]}): concurrent tokens differ from the same request alone"
        assert ut == ua, f"request {i}: usage differs"
        assert ut["prompt_tokens"] == len(reqs[i][0].encode()) and ut["completion_tokens"] == reqs[i][1]
        assert ut["total_tokens"] == ut["prompt_tokens"] + ut["completion_tokens"]
        assert len(tt.split()) == reqs[i][1]

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("spade_completion_tokens_total") == sum(u["completion_tokens"] for _, u in together)
    assert delta("spade_prompt_tokens_total") == sum(u["prompt_tokens"] for _, u in together)
    assert delta("spade_generation_tokens_total") >= sum(u["completion_tokens"] for _, u in together)
    assert delta("spade_time_to_first_token_seconds_count") == 16
    assert delta("spade_sparse_decode_steps_total") > 0  # past policy.budget the rows decode sparsely
    assert delta("spade_request_finished_total", finish_reason="length") == 16
    _idle(http, server)


# --------------------------------------------------------------------------- raw HTTP
def _auth():
    return {"Authorization": f"Bearer {KEY}"}


def _sse_events(raw: str) -> list[str]:
    """The data payloads of a server-sent event stream; checks its framing."""
    assert raw.endswith("\n\n"), "an SSE stream ends with a blank line"
    events = raw[:-2].split("\n\n")
    out = []
    for ev in events:
        assert ev.startswith("data: ") and "\n" not in ev, f"bad SSE event: {ev!r}"
        out.append(ev[len("data: "):])
    return out


@pytest.mark.parametrize("chat", [False, True])
def test_sse_framing_and_done(server, http, chat):
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[2]}]}
    else:
        path, body = "/v1/completions", {"prompt": PROMPTS[2]}
    body.update(model=MODEL, max_tokens=4, temperature=0)
    full = http.post(server.url + path, json=body, headers=_auth(), timeout=120).json()
    r = http.post(server.url + path, json={**body, "stream": True}, headers=_auth(), timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(r.text)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    finals = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finals[-1] == full["choices"][0]["finish_reason"] and all(f is None for f in finals[:-1])
    if chat:
        assert chunks[0]["object"] == "chat.completion.chunk"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == full["choices"][0]["message"]["content"]
    else:
        assert chunks[0]["object"] == "text_completion"
        assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert "usage" not in chunks[-1]  # only with stream_options.include_usage


BAD = [  # (path, body, status, param)
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": "x",', 400, None),  # malformed JSON
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 400, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 384}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": list(range(1, 400)), "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "warm"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    # refused by AsyncEngine.generate before any work, passed on naming the field
    ("/v1/completions", {"model": MODEL, "prompt": [1, 10 ** 6]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [10 ** 6]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{p}-{i}" for i, (p, *_) in enumerate(BAD)])
def test_error_objects(server, http, path, body, status, param):
    kw = {"content": body, "headers": {**_auth(), "Content-Type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body, "headers": _auth()}
    r = http.post(server.url + path, timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    if param:
        assert param in err["message"]


def test_error_through_sdk(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_api_key(server, http):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = http.post(server.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert http.get(server.url + "/v1/models", timeout=30).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base, api_key="nope", max_retries=0).models.list()
    assert http.get(server.url + "/health", timeout=30).status_code == 200  # probes need no key


def _idle(http, server, timeout=30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(http, server)
        busy = [metric(m, n) for n in ("spade_num_requests_running", "spade_num_requests_waiting",
                                       "spade_slots_used", "spade_http_requests_in_flight")]
        if all(v in (0, None) for v in busy):
            return m
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {busy}"
        time.sleep(0.2)


def test_disconnect_aborts_and_frees_the_slot(server, http):
    before = _idle(http, server)
    aborted0 = metric(before, "spade_request_finished_total", finish_reason="abort")
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 300, "temperature": 0, "stream": True}
    with http.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body, headers=_auth()) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # held: a dropped iterator would close the stream here
            for line in lines:
                if line.startswith("data: "):
                    break  # the first token arrived: the request holds a slot
            m = _metrics(http, server)
            assert metric(m, "spade_http_requests_in_flight") == 1
    # the connection is closed: the server aborts the request and frees its slot
    after = _idle(http, server)
    assert metric(after, "spade_request_finished_total", finish_reason="abort") == aborted0 + 1
    gen = metric(after, "spade_generation_tokens_total")
    time.sleep(0.5)
    assert metric(_metrics(http, server), "spade_generation_tokens_total") == gen  # nothing decodes for it


def test_disconnect_without_streaming_aborts_too(server, http):
    before = _idle(http, server)
    aborted0 = metric(before, "spade_request_finished_total", finish_reason="abort")
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 300, "ignore_eos": True}
    with pytest.raises(http.TimeoutException):  # the client gives up and closes the connection
        http.post(server.url + "/v1/completions", json=body, headers=_auth(), timeout=3)
    after = _idle(http, server)
    assert metric(after, "spade_request_finished_total", finish_reason="abort") == aborted0 + 1


def test_request_timeout_is_504_and_frees_the_slot(server, http):
    """serve.request_timeout_s (5 s here; 340 SmolLM2 tokens take far longer on a CPU)."""
    t0 = time.monotonic()
    r = http.post(server.url + "/v1/completions", headers=_auth(), timeout=120,
                  json={"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 340, "ignore_eos": True})
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout", r.text
    assert 4.5 < time.monotonic() - t0 < 60
    _idle(http, server)


def test_metrics_exposition(server, http):
    m = _metrics(http, server)
    for name in ("spade_num_requests_running", "spade_num_requests_waiting", "spade_generation_tokens_total",
                 "spade_late_packs_total", "spade_topk_fallbacks_total", "spade_joins_held_by_cursor_total"):
        assert f"# TYPE {name} " in m, name
    labels = 'model="smollm2-135m",policy="asyncspade",topology="inline",transport="local"'
    assert f"spade_time_to_first_token_seconds_bucket{{{labels},le=\"+Inf\"}}" in m
    assert f"spade_time_per_output_token_seconds_count{{{labels}}}" in m


def test_sigint_past_the_grace_period_aborts_and_exits_0(server, http):
    """The last test on ``server``: SIGINT (Ctrl-C; SIGTERM is the same path, tested
    below) with a request that cannot finish within
    ``serve.shutdown_grace_s`` (2 s; 340 SmolLM2 tokens take far longer on a CPU): it is
    cut short, the server still exits 0."""
    out: dict = {}
    t = _stream_in_thread(http, server.url, {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 340,
                                             "stream": True, "ignore_eos": True}, out, headers=_auth())
    _wait_events(out)
    server.proc.send_signal(signal.SIGINT)
    rc = server.proc.wait(120)
    t.join(60)
    assert rc == 0, server.log()
    events = [json.loads(e) for e in out.get("events", []) if e != "[DONE]"]
    assert len(events) < 340  # cut short
    assert "length" not in [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]


# --------------------------------------------------------------------------- overload and shutdown
TINY = """
model: {name: tiny, dtype: float32, device: cpu, max_seq_len: 256}
policy: {name: quest, budget: 32, page_size: 4}
runtime: {topology: colocated}
serving: {max_batch: 3}
serve: {max_waiting: %(waiting)d, shutdown_grace_s: %(grace)s}
"""


def _stream_in_thread(http, url, body, out: dict, headers=None):
    def run():
        try:
            with http.Client(timeout=120) as c:
                with c.stream("POST", url + "/v1/completions", json=body, headers=headers or {}) as r:
                    out["status"] = r.status_code
                    out["events"] = []
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            out["events"].append(line[6:])
        except Exception as e:  # a connection the server closed
            out["error"] = repr(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_events(out: dict, n: int = 1, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while len(out.get("events", [])) < n:
        assert "error" not in out and time.monotonic() < deadline, out
        time.sleep(0.05)


def test_overload_429_then_sigterm_drains_and_exits_0(tmp_path, http):
    """A full batch plus a full queue: 429 with Retry-After (no hang). Then SIGTERM with
    requests in flight: they finish, the server exits 0, no child process is left."""
    s = LiveServer(tmp_path, TINY % {"waiting": 0, "grace": 30})
    try:
        stats = _metrics(http, s)
        slots = int(metric(stats, "spade_slots_used") + metric(stats, "spade_slots_free"))
        outs = [{} for _ in range(slots)]
        body = {"model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 60, "stream": True, "ignore_eos": True}
        threads = [_stream_in_thread(http, s.url, body, o) for o in outs]
        for o in outs:
            _wait_events(o)
        r = http.post(s.url + "/v1/completions", json={**body, "stream": False}, timeout=30)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        kids = children(s.proc.pid)
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        rc = s.proc.wait(120)
    finally:
        s.stop(signal.SIGKILL)
    assert rc == 0, s.log()
    for o in outs:  # every stream in flight ran to its end
        assert o.get("status") == 200 and o["events"][-1] == "[DONE]", o
        assert json.loads(o["events"][-2])["choices"][0]["finish_reason"] == "length"
    assert not [k for k in kids if alive(k)], "child processes outlived the server"
