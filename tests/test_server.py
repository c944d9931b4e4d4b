"""The HTTP server over real HTTP on loopback, with the official ``openai`` client.

One server subprocess (``python -m bloomery_jax.serve``) on a tiny synthetic qwen3moe model
(F32, 2 layers, 512-token vocabulary) serves the whole module: 2 slots, a queue of 6, a
context of 1024, prefill chunks of up to 32 tokens, an API key. Raw sockets stand in for
clients that disconnect or hold a slot. Texts of the random model are bytes soup; the tests
compare them with each other (greedy is deterministic, so a request alone and beside others
must give the same text) rather than with expected words.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

KEY = "test-key-123"
N_CTX = 1024
PARALLEL, QUEUE = 2, 6
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Generous: 2 busy cores shared with other test runs; a step takes tens of ms when idle.
FREED_WITHIN_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc, port, log_path, health_seen):
        self.proc, self.port, self.log_path, self.health_seen = proc, port, log_path, health_seen
        self.url = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {KEY}"}
        self.http = httpx.Client(base_url=self.url, headers=self.headers, timeout=120)
        # max_retries=0: the client would otherwise retry a 503 by itself.
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        self.model = self.http.get("/v1/models").json()["data"][0]["id"]

    def _status(self, field: str) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    def rss_kib(self) -> int:
        return self._status("VmRSS")

    def threads(self) -> int:
        return self._status("Threads")

    def metric(self, name: str) -> float:
        total = 0.0
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(f"bloomery_{name}") and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def idle(self) -> bool:
        h = self.http.get("/health").json()
        return h["slots_processing"] == 0 and h["requests_waiting"] == 0

    def wait_idle(self, within: float = FREED_WITHIN_S) -> float:
        t0 = time.monotonic()
        while not self.idle():
            assert time.monotonic() - t0 < within, f"slots still busy after {within} s: {self.http.get('/slots').json()}"
            time.sleep(0.02)
        return time.monotonic() - t0


def start_server(args: list[str], log_path, timeout: float = 600.0, env: dict | None = None):
    port = _free_port()
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "bloomery_jax.serve", "--port", str(port), *args],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    seen = []
    t0 = time.monotonic()
    while True:
        assert proc.poll() is None, f"server exited with {proc.returncode}:\n{open(log_path).read()}"
        assert time.monotonic() - t0 < timeout, f"server not ready in {timeout} s:\n{open(log_path).read()}"
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                return proc, port, seen
        except httpx.TransportError:
            pass
        time.sleep(0.1)


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def server(synth_model, tmp_path_factory):
    path, _ = synth_model()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    # glibc keeps freed blocks of up to twice its (self-raising) mmap threshold in each thread's
    # arena; with the step's XLA temporaries (about 14 MiB here) RSS moved in 14 MiB steps
    # between soak windows with no live memory behind them. A fixed threshold hands such blocks
    # back at once, so the soak's RSS follows live memory.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    proc, port, seen = start_server(
        ["--model", str(path), "--parallel", str(PARALLEL), "--queue", str(QUEUE), "--api-key", KEY,
         "--timeout", "120", "--gin_param", f"RuntimeSettings.max_context = {N_CTX}",
         "--gin_param", "RuntimeSettings.ubatch = 32"], log_path, env=env)
    srv = Server(proc, port, log_path, seen)
    yield srv
    stop_server(proc)


# --- raw clients ---------------------------------------------------------------------------
def raw_post(srv: Server, path: str, body: dict, key: str | None = KEY) -> socket.socket:
    """Send a POST and return the open socket (the caller reads or just closes it)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def read_until(s: socket.socket, marker: bytes) -> bytes:
    buf = b""
    while marker not in buf:
        chunk = s.recv(65536)
        assert chunk, f"connection closed before {marker!r}: {buf!r}"
        buf += chunk
    return buf


MSG = [{"role": "user", "content": "hi"}]
# A request that runs until cancelled: token 300 (a plain byte-level piece, not an end-of-turn
# token) is forced, so no stop comes before its 1000 tokens (seconds even on an idle machine).
HOLD = {"prompt": "hold", "max_tokens": 1000, "stream": True, "logit_bias": {"300": 100}}
HOLD_CHAT = {"messages": MSG, "max_tokens": 1000, "stream": True, "logit_bias": {"300": 100}}


def chat(srv, content="hello", **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 8)
    return srv.client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": content}], **kw)


def stream_text(srv, content="hello", **kw) -> tuple[str, list]:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 8)
    chunks = list(srv.client.chat.completions.create(
        model=srv.model, messages=[{"role": "user", "content": content}], stream=True, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


# --- start-up, models, health --------------------------------------------------------------
def test_health_is_503_while_loading_then_ready(server):
    codes = [c for c, _ in server.health_seen]
    assert codes[0] == 503 and codes[-1] == 200, codes
    body = server.health_seen[0][1]
    assert body["error"]["message"] == "Loading model" and body["error"]["type"] == "unavailable_error"
    log = open(server.log_path).read()
    assert f"ready at http://127.0.0.1:{server.port}/v1" in log


GREEDY_IDLE = "compiled the greedy sampler's decode steps while idle"


def test_greedy_sampler_compiles_while_idle_and_keeps_the_tokens(server):
    """Greedy batches take the full sampler until the greedy plan's decode steps have compiled,
    which the worker does while idle, so start-up compiles one plan: the same tokens either way.
    (Run early: the first chat normally still finds the greedy plan cold.)"""
    cold = GREEDY_IDLE not in open(server.log_path).read()
    before = chat(server, content="plans", max_tokens=8).choices[0].message.content
    deadline = time.monotonic() + 300
    while GREEDY_IDLE not in open(server.log_path).read():
        assert time.monotonic() < deadline, open(server.log_path).read()[-2000:]
        time.sleep(0.5)
    after = chat(server, content="plans", max_tokens=8).choices[0].message.content
    assert after == before, (cold, before, after)


def test_models_lists_the_served_model(server):
    models = server.client.models.list().data
    assert len(models) == 1 and models[0].id == server.model
    meta = server.http.get("/v1/models").json()["data"][0]["meta"]
    assert meta["n_ctx"] == N_CTX and meta["n_vocab"] == 512 and meta["n_slots"] == PARALLEL


# --- chat and completions ------------------------------------------------------------------
def test_chat_greedy_is_complete_and_deterministic(server):
    a, b = chat(server, max_tokens=8), chat(server, max_tokens=8)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.role == "assistant"
    if a.choices[0].finish_reason == "length":
        assert a.usage.completion_tokens == 8
    else:  # the random model may emit an end-of-turn token first
        assert a.choices[0].finish_reason == "stop" and a.usage.completion_tokens <= 8
    t = a.model_extra["timings"]
    assert t["prompt_n"] == a.usage.prompt_tokens and t["predicted_n"] == a.usage.completion_tokens
    assert t["prompt_per_second"] > 0 and t["predicted_per_second"] > 0


def test_prompt_tokens_match_tokenize_of_the_template(server):
    # ChatML template of the synthetic vocabulary, rendered with the generation prompt.
    text = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    ids = server.http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert chat(server, max_tokens=1).usage.prompt_tokens == len(ids)


def test_stream_equals_non_stream_and_ends_with_done(server):
    full = chat(server, "a story", max_tokens=12).choices[0].message.content
    text, chunks = stream_text(server, "a story", max_tokens=12, stream_options={"include_usage": True})
    assert text == full
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("length", "stop")
    assert "timings" in finals[0].model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert len({c.id for c in chunks}) == 1
    # The raw SSE framing: data lines, blank-line separated, the last one [DONE].
    with server.http.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_tools_and_tool_turns_reach_the_template(server):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    plain = server.client.chat.completions.create(model=server.model, messages=history[:1], max_tokens=1)
    with_tools = server.client.chat.completions.create(model=server.model, messages=history[:1], tools=tools,
                                                       max_tokens=1)
    # The ChatML template lists the tools (their JSON) in a system turn.
    tool_json = json.dumps(tools[0], ensure_ascii=False)
    n_tool = len(server.http.post("/tokenize", json={"content": tool_json}).json()["tokens"])
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + n_tool // 2
    none = server.client.chat.completions.create(model=server.model, messages=history[:1], tools=tools,
                                                 tool_choice="none", max_tokens=1)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    turns = server.client.chat.completions.create(model=server.model, messages=history, tools=tools, max_tokens=1)
    assert turns.usage.prompt_tokens > with_tools.usage.prompt_tokens


def test_completions_from_text_and_from_ids_agree(server):
    ids = server.http.post("/tokenize", json={"content": "once upon", "add_special": True}).json()["tokens"]
    a = server.client.completions.create(model=server.model, prompt="once upon", max_tokens=6, temperature=0)
    b = server.client.completions.create(model=server.model, prompt=ids, max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == len(ids)
    s = list(server.client.completions.create(model=server.model, prompt="once upon", max_tokens=6, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in s) == a.choices[0].text
    assert s[-1].choices[0].finish_reason == a.choices[0].finish_reason


def test_completion_logprobs_legacy_shape(server):
    r = server.client.completions.create(model=server.model, prompt="abc", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")  # a stop token is not listed
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(len(t) <= 3 for t in lp.top_logprobs)  # byte pieces may share a text ('\ufffd')
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_are_the_greedy_token_and_sorted(server):
    r = chat(server, max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert content, "no logprobs"
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        # Greedy without penalties picks the raw argmax: the top entry (same bytes, same logprob).
        assert entry.bytes == entry.top_logprobs[0].bytes and entry.logprob == tops[0]
        assert entry.logprob <= 0


def test_stop_string_cuts_the_text(server):
    full = server.client.completions.create(model=server.model, prompt="the", max_tokens=24, temperature=0)
    text = full.choices[0].text
    # Pick a printable two-character stop string inside the text (not at its start).
    k = next((i for i in range(1, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isprintable()), None)
    assert k is not None, f"no printable pair in {text!r}"
    stop = text[k:k + 2]
    r = server.client.completions.create(model=server.model, prompt="the", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.find(stop)]


def test_logit_bias_forces_a_token(server):
    tok = server.http.post("/tokenize", json={"content": "ab"}).json()["tokens"][0]
    piece = server.http.post("/detokenize", json={"tokens": [tok]}).json()["content"]
    r = server.client.completions.create(model=server.model, prompt="x", max_tokens=5, temperature=0,
                                         logit_bias={str(tok): 100})
    assert r.choices[0].text == piece * 5


def test_seeded_sampling_is_reproducible(server):
    def draw(seed):
        r = server.client.completions.create(model=server.model, prompt="q", max_tokens=10, temperature=1.0,
                                             top_p=1.0, seed=seed, extra_body={"top_k": 0, "min_p": 0.0})
        return r.choices[0].text

    assert draw(1234) == draw(1234)


def test_two_concurrent_streams_overlap_and_match_solo(server):
    prompts = ["first prompt", "second one"]
    solo = [chat(server, p, max_tokens=16).choices[0].message.content for p in prompts]
    spans = {}

    def run(p):
        t0 = time.monotonic()
        out, _ = stream_text(server, p, max_tokens=16)
        spans[p] = (t0, time.monotonic())
        return out

    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(run, prompts))
    assert got == solo
    (a0, a1), (b0, b1) = spans.values()
    assert a0 < b1 and b0 < a1, spans


def test_long_prompt_beside_a_short_one(server):
    # 200+ prompt tokens: prefilled in chunks of 32 (ubatch), one chunk per step beside the
    # other request's decode steps; neither may change the other's greedy tokens.
    long_text = " ".join(f"w{i}" for i in range(80))
    n_long = len(server.http.post("/tokenize", json={"content": long_text}).json()["tokens"])
    assert n_long > 4 * 32
    prompts = [long_text, "short"]
    solo = [server.client.completions.create(model=server.model, prompt=p, max_tokens=12, temperature=0)
            .choices[0].text for p in prompts]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda p: server.client.completions.create(
            model=server.model, prompt=p, max_tokens=12, temperature=0).choices[0].text, prompts))
    assert got == solo


def test_time_limit_ends_a_request(server):
    r = chat(server, max_tokens=1000, logit_bias={"300": 100}, extra_body={"timeout": 0.5})
    assert r.choices[0].finish_reason == "length" and r.model_extra.get("stopped_by") == "time_limit"
    assert r.usage.completion_tokens < 1000
    server.wait_idle()


# --- disconnects and the queue -------------------------------------------------------------
def test_disconnect_mid_stream_frees_the_slot(server):
    before = server.metric('requests_finished_total{reason="cancelled"}')
    s = raw_post(server, "/v1/chat/completions", HOLD_CHAT)
    read_until(s, b'"content":')  # generating
    assert any(x["is_processing"] for x in server.http.get("/slots").json())
    s.close()
    server.wait_idle()
    assert server.metric('requests_finished_total{reason="cancelled"}') == before + 1


def test_disconnect_while_waiting_non_streaming(server):
    s = raw_post(server, "/v1/completions", {**HOLD, "stream": False})
    t0 = time.monotonic()
    while server.idle():
        assert time.monotonic() - t0 < FREED_WITHIN_S
        time.sleep(0.01)
    s.close()
    assert server.wait_idle() < FREED_WITHIN_S


def test_full_queue_answers_503_and_drains(server):
    holders = []
    try:
        for _ in range(PARALLEL + QUEUE):
            holders.append(raw_post(server, "/v1/completions", HOLD))
        t0 = time.monotonic()
        while (server.metric("requests_processing"), server.metric("requests_deferred")) != (PARALLEL, QUEUE):
            assert time.monotonic() - t0 < 30, server.http.get("/health").json()
            time.sleep(0.05)
        r = server.http.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "unavailable_error"
        with pytest.raises(openai.APIStatusError) as e:
            server.client.completions.create(model=server.model, prompt="x", max_tokens=2)
        assert e.value.status_code == 503
    finally:
        for s in holders:
            s.close()
    server.wait_idle()
    assert chat(server, max_tokens=2).usage.completion_tokens >= 1


# --- bad requests and auth -----------------------------------------------------------------
BAD = [
    ("/v1/chat/completions", b'{"messages": [', None, "invalid_json"),
    ("/v1/chat/completions", b'[1, 2]', None, "invalid_json"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', None,
     "invalid_json"),
    ("/v1/chat/completions", {}, "messages", None),
    ("/v1/chat/completions", {"messages": []}, "messages", None),
    ("/v1/chat/completions", {"messages": "hi"}, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", None),
    ("/v1/chat/completions", {"messages": MSG, "temperature": "1"}, "temperature", None),
    ("/v1/chat/completions", {"messages": MSG, "temperature": 3}, "temperature", None),
    ("/v1/chat/completions", {"messages": MSG, "top_p": 1.5}, "top_p", None),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 0}, "max_tokens", None),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2.5}, "max_tokens", None),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": -1}, "max_completion_tokens", None),
    ("/v1/chat/completions", {"messages": MSG, "presence_penalty": 9}, "presence_penalty", None),
    ("/v1/chat/completions", {"messages": MSG, "seed": 1.5}, "seed", None),
    ("/v1/chat/completions", {"messages": MSG, "top_k": 10 ** 12}, "top_k", None),
    ("/v1/chat/completions", {"messages": MSG, "repetition_penalty": 0}, "repetition_penalty", None),
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 100000 + b"]" * 100000 + b"}", None, "invalid_json"),
    ("/v1/chat/completions", {"messages": MSG, "n": 2}, "n", None),
    ("/v1/chat/completions", {"messages": MSG, "stream": "yes"}, "stream", None),
    ("/v1/chat/completions", {"messages": MSG, "stop": ["a", 3]}, "stop[1]", None),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": MSG, "logit_bias": {"5": 500}}, "logit_bias", None),
    ("/v1/chat/completions", {"messages": MSG, "logit_bias": {"99999": 1}}, "logit_bias", None),
    ("/v1/chat/completions", {"messages": MSG, "model": "gpt-4o"}, "model", "model_not_found"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * N_CTX}]}, "messages",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {"range": [1]}}, "chat_template_kwargs",
     None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type", None),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens", None),
    ("/v1/completions", {"prompt": [1, 2, 70000]}, "prompt[2]", None),
    ("/v1/completions", {"prompt": [i % 500 for i in range(N_CTX)]}, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": ""}, "prompt", None),
    ("/v1/completions", {"prompt": "a", "logprobs": 50}, "logprobs", None),
    ("/v1/completions", {"prompt": "a", "echo": True}, "echo", None),
    ("/tokenize", {"content": 5}, "content", None),
    ("/detokenize", {"tokens": [1, -4]}, "tokens[1]", None),
]


@pytest.mark.parametrize("path,body,param,code", BAD, ids=[f"{p}:{str(b)[:40]}" for p, b, _, _ in BAD])
def test_bad_request_is_400_naming_the_field(server, path, body, param, code):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = server.http.post(path, headers={"Content-Type": "application/json"}, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]
    if code is not None:
        assert err["code"] == code


def test_bad_requests_do_not_disturb_the_server(server):
    before = chat(server, "steady", max_tokens=6).choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model="no-such-model", messages=MSG)
    assert "no-such-model" in str(e.value)
    r = server.http.post("/v1/chat/completions", content=b"\xff\xfe garbage")
    assert r.status_code == 400
    assert server.http.get("/nope").status_code == 404 and "error" in server.http.get("/nope").json()
    assert chat(server, "steady", max_tokens=6).choices[0].message.content == before
    assert server.http.get("/health").status_code == 200


def test_api_key_is_required(server):
    for key in (None, "wrong-key"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSG}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(server.url + "/metrics", headers=headers).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # public, like llama-server's


# --- native endpoints ----------------------------------------------------------------------
def test_tokenize_detokenize_round_trip(server):
    text = "hello world, 123"
    ids = server.http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert ids and all(isinstance(i, int) for i in ids)
    assert server.http.post("/detokenize", json={"tokens": ids}).json()["content"] == text
    pieces = server.http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == text


def test_metrics_count_tokens(server):
    text = server.http.get("/metrics").text
    for name in ("prompt_tokens_total", "tokens_predicted_total", "prompt_tokens_per_second",
                 "predicted_tokens_per_second", "requests_processing", "requests_deferred"):
        assert f"# TYPE bloomery_{name} " in text
    p0, g0 = server.metric("prompt_tokens_total"), server.metric("tokens_predicted_total")
    r = chat(server, max_tokens=5)
    assert server.metric("prompt_tokens_total") == p0 + r.usage.prompt_tokens
    assert server.metric("tokens_predicted_total") == g0 + r.usage.completion_tokens


def test_slots_show_a_running_request(server):
    s = raw_post(server, "/v1/chat/completions", {**HOLD_CHAT, "temperature": 0.5})
    try:
        read_until(s, b'"content":')
        slots = server.http.get("/slots").json()
        assert len(slots) == PARALLEL and all(x["n_ctx"] == N_CTX for x in slots)
        busy = [x for x in slots if x["is_processing"]]
        assert len(busy) == 1 and busy[0]["params"]["temperature"] == 0.5 and busy[0]["n_prompt_tokens"] > 0
    finally:
        s.close()
    server.wait_idle()


# --- soak ----------------------------------------------------------------------------------
def _one(srv: Server, i: int) -> None:
    """One request of the soak, checked for completeness."""
    n = 3 + i % 4
    if i % 4 == 0:
        r = chat(srv, f"soak {i}", max_tokens=n, temperature=0.7, seed=i)
        c = r.choices[0]
        assert c.finish_reason in ("length", "stop") and (c.finish_reason == "stop" or r.usage.completion_tokens == n)
    elif i % 4 == 1:
        text, chunks = stream_text(srv, f"soak {i}", max_tokens=n)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    elif i % 4 == 2:
        r = srv.client.completions.create(model=srv.model, prompt=f"soak {i}", max_tokens=n, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= n
    else:
        with srv.http.stream("POST", "/v1/completions", json={"prompt": f"soak {i}", "max_tokens": n,
                                                               "stream": True}) as resp:
            assert resp.status_code == 200
            raw = resp.read().decode()
        assert raw.endswith("data: [DONE]\n\n") and '"finish_reason":"' in raw


def _soak(srv: Server, n_requests: int, concurrency: int = 8) -> dict:
    peak = {"processing": 0, "deferred": 0, "total": 0}
    done = threading.Event()

    def watch():
        while not done.is_set():
            h = srv.http.get("/health").json()  # one snapshot of both counts
            run, wait = h["slots_processing"], h["requests_waiting"]
            peak.update(processing=max(peak["processing"], run), deferred=max(peak["deferred"], wait),
                        total=max(peak["total"], run + wait))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda i: _one(srv, i), range(n_requests)))  # re-raises the first failure
    finally:
        done.set()
        watcher.join()
    return peak


def _check_soak(server, n_requests: int, rss_bound_mib: float):
    _soak(server, 16)  # settle allocator pools and caches before the first measurement
    rss0, threads0 = server.rss_kib(), server.threads()
    rejected0 = server.metric("requests_rejected_total")
    t0 = time.monotonic()
    peak = _soak(server, n_requests // 2)
    rss1 = server.rss_kib()
    peak2 = _soak(server, n_requests - n_requests // 2)
    rss2 = server.rss_kib()
    elapsed = time.monotonic() - t0
    # 8 at a time fit 2 slots + 6 queued: nobody is refused, the bound is never exceeded.
    assert server.metric("requests_rejected_total") == rejected0
    assert max(peak["processing"], peak2["processing"]) <= PARALLEL
    assert max(peak["total"], peak2["total"]) <= PARALLEL + QUEUE
    assert max(peak["deferred"], peak2["deferred"]) >= 1  # the queue was really used
    server.wait_idle()
    assert server.metric("requests_in_flight") == 0  # the provider's job table is empty again
    # Requests are prepared on a fixed pool: more clients never add threads (each brings a
    # malloc arena of its own).
    assert server.threads() == threads0
    # RSS: a leaked copy of the KV cache ([2, 2, 1024, 2, 64] f32 keys + values = 2 MiB) or of
    # device arrays per request would pass the bound within 8 requests; measured growth is
    # under 1 MiB per 1000 requests (with the fixed mmap threshold the fixture sets).
    grow1, grow2 = (rss1 - rss0) / 1024, (rss2 - rss1) / 1024
    print(f"soak {n_requests} requests in {elapsed:.1f} s; RSS {rss0 / 1024:.0f} MiB, +{grow1:.1f}, +{grow2:.1f}")
    assert grow1 + grow2 < rss_bound_mib, (rss0, rss1, rss2)


def test_soak_200_requests_8_at_a_time(server):
    _check_soak(server, 200, rss_bound_mib=16)


def test_hybrid_server_reports_expert_placement(synth_model, tmp_path_factory):
    """A second server with 2 of each layer's experts on the card and LFU residency: requests
    complete, and /metrics counts routed and card-served expert calls and the swaps."""
    path, _ = synth_model(route_skew=2.0)
    log_path = tmp_path_factory.mktemp("hybrid") / "server.log"
    proc, port, seen = start_server(
        ["--model", str(path), "--parallel", "1", "--api-key", KEY, "--place", "card-experts=2",
         "--residency", "lfu", "--gin_param", "RuntimeSettings.max_context = 256",
         "--gin_param", "RuntimeSettings.ubatch = 32"], log_path)
    try:
        srv = Server(proc, port, log_path, seen)
        for content in ("hello", "the hot experts should move to the card"):
            r = chat(srv, content, max_tokens=12)
            assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
        routed, card = srv.metric("expert_calls_total"), srv.metric("expert_calls_card_total")
        assert routed > 0 and 0 < card <= routed
        assert srv.metric("expert_card_served_ratio") == pytest.approx(card / routed)
        assert srv.metric("expert_swaps_total") > 0 and srv.metric("expert_swap_bytes_total") > 0
    finally:
        stop_server(proc)
