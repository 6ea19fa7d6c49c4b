"""The OpenAI-compatible server, started for real in a subprocess and driven with the official
openai client and httpx."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from medha.benchmark.local_server import START_TRIES, lost_port
from medha.utils.net import free_port


class PortLost(RuntimeError):
    """The server could not bind the free port it was given: another process has it."""


KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# httpx's default (5 s between bytes) is short for a 2-core machine that runs other jobs: a
# server busy with a long prefill, or descheduled, can be silent that long
TIMEOUT_S = 120


class Server:
    def __init__(self, *flags: str) -> None:
        for attempt in range(1, START_TRIES + 1):
            try:
                return self._start(flags)
            except PortLost:  # another process took the free port before the server bound it
                if attempt == START_TRIES:
                    raise

    def _start(self, flags) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "medha",
                "serve",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                "--kv-memory-gb",
                "0.25",
                "--dtype",
                "float32",  # as the in-process engines the tests compare with (conftest)
                # a fixed thread count: the thread governor (on without it) follows the
                # machine's load, and two runs of one prompt would sum in different orders
                "--threads",
                "2",
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 240  # first start converts the embedded model
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                output = self.proc.stdout.read()
                if lost_port(self.port, output):
                    raise PortLost(output)
                raise RuntimeError(f"server exited {self.proc.returncode}: {output}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.proc.kill()
        raise RuntimeError("server did not come up")

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=TIMEOUT_S).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 60) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = (
                m["medha_kv_blocks_used"]
                + m["medha_num_requests_waiting"]
                + m["medha_num_requests_prefilling"]
                + m["medha_num_requests_running"]
            )
            if busy == 0 or time.monotonic() > deadline:
                return m
            time.sleep(0.2)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def server():
    # the cache off: several tests send a prompt twice and compare the answers and their usage
    # (streamed or not); with it the second would start after the first's cached blocks
    # (cached_tokens, and bf16 rounding of other chunk boundaries, would differ)
    s = Server("--api-key", KEY, "--prefix-cache", "off")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).json() == {"status": "ok"}


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=12, temperature=0
    )
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 12 or full.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[
        0
    ].finish_reason


def test_completions_stream_equals_non_stream(client):
    full = client.completions.create(
        model="smollm2",
        prompt="Once upon a time",
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 10
    parts = list(
        client.completions.create(
            model="smollm2",
            prompt="Once upon a time",
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(p.choices[0].text for p in parts) == full.choices[0].text


def test_token_prompts_batches_echo_and_logprobs(client):
    out = client.completions.create(
        model="smollm2", prompt=["Hello", "Good morning"], max_tokens=2, temperature=0, echo=True
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[1].text.startswith("Good morning")
    out = client.completions.create(
        model="smollm2",
        prompt=[504, 3575, 282],
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(t) == 2 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    # greedy: the chosen token is the likeliest
    assert all(
        lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values())) for i in range(4)
    )
    chat = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    assert all(len(t.top_logprobs) == 3 for t in chat.choices[0].logprobs.content)


def test_seeded_sampling_is_reproducible(client):
    kw = dict(
        model="smollm2",
        prompt="The weather today",
        max_tokens=8,
        temperature=1.0,
        top_p=0.9,
        seed=7,
    )
    assert (
        client.completions.create(**kw).choices[0].text
        == client.completions.create(**kw).choices[0].text
    )


def test_slo_fields_are_accepted(client):
    out = client.completions.create(
        model="smollm2",
        prompt="Hi",
        max_tokens=2,
        extra_body={"medha": {"priority": "HIGH", "ttft_slo_s": 2.0, "tpot_slo_s": 0.5}},
    )
    assert out.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "n": 3}, 400, "n"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
        ("/v1/completions", {"prompt": "hi", "medha": {"ttft_slo_s": 0}}, 400, "medha.ttft_slo_s"),
        (
            "/v1/completions",
            {"prompt": "hi", "medha": {"priority": "URGENT"}},
            400,
            "medha.priority",
        ),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "wizard", "content": "x"}]},
            400,
            "messages.0.role",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9000},
            400,
            "max_tokens",
        ),
    ],
)
def test_invalid_requests_get_openai_errors(server, path, body, status, param):
    r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=TIMEOUT_S)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]


def test_malformed_json_and_auth(server):
    for content_type in ("application/json", "text/plain"):
        r = httpx.post(
            server.url + "/v1/completions",
            content=b"{not json",
            headers=AUTH | {"Content-Type": content_type},
            timeout=TIMEOUT_S,
        )
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "hi"},
            headers=headers,
            timeout=TIMEOUT_S,
        )
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope").models.list()


def test_metrics_count_requests_and_latencies(server, client):
    before = server.metrics()
    client.completions.create(model="smollm2", prompt="Count", max_tokens=3)
    httpx.post(server.url + "/v1/completions", json={"prompt": ""}, headers=AUTH, timeout=TIMEOUT_S)
    after = server.wait_idle()
    assert (
        after['medha_requests_total{status="ok"}']
        == before['medha_requests_total{status="ok"}'] + 1
    )
    assert (
        after['medha_requests_total{status="invalid"}']
        >= before['medha_requests_total{status="invalid"}'] + 1
    )
    assert (
        after["medha_time_to_first_token_seconds_count"]
        == before["medha_time_to_first_token_seconds_count"] + 1
    )
    assert after["medha_iteration_seconds_count"] > before["medha_iteration_seconds_count"]
    assert after["medha_kv_blocks_total"] > 0 and after["medha_kv_blocks_used"] == 0
    # the prefill-phase queue in two gauges: not started, and started
    assert after["medha_num_requests_waiting"] == after["medha_num_requests_prefilling"] == 0


def test_prefix_cache_hits_show_in_usage_and_metrics(client):
    # the module's server runs with --prefix-cache off: a repeat finds nothing
    messages = [{"role": "user", "content": "Tell me about ferries. " * 30}]
    for _ in range(2):
        out = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=2)
        assert out.usage.prompt_tokens_details.cached_tokens == 0
    cached = Server()  # `medha serve` caches prefixes by default
    try:
        c = openai.OpenAI(base_url=cached.url + "/v1", api_key="none", max_retries=0)
        first = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=2)
        messages += [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Go"}]
        second = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=2)
        m = cached.wait_idle()
    finally:
        assert cached.stop() == 0
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hit = second.usage.prompt_tokens_details.cached_tokens
    # the whole first prompt but its last, partial block (32 tokens on vLLM's kernels, 16 on
    # torch's) and the tokens of the chat template that changed after it
    assert first.usage.prompt_tokens - 32 <= hit < second.usage.prompt_tokens
    assert m["medha_prefix_cache_hits_tokens"] == hit
    assert m["medha_prefix_cache_queries_tokens"] == (
        first.usage.prompt_tokens + second.usage.prompt_tokens
    )
    assert m["medha_prefix_cache_hit_rate"] == pytest.approx(
        hit / m["medha_prefix_cache_queries_tokens"]
    )


async def _disconnect(url: str, rng: random.Random) -> None:
    prompt = [rng.randrange(1000, 30000) for _ in range(rng.randint(8, 120))]
    stream = rng.random() < 0.8
    body = {
        "prompt": prompt,
        # a request not streamed is given up within a second: 4000 tokens (of the 5,800 its
        # KV holds) take longer on any CPU (a decode step of SmolLM2 reads its 540 MB of
        # float32 weights: over a millisecond even at 400 GB/s)
        "max_tokens": 200 if stream else 4000,
        "ignore_eos": True,
        "stream": stream,
    }
    # a stream waits for its first token behind up to 15 others: minutes on a slow CPU
    async with httpx.AsyncClient(headers=AUTH, timeout=180) as c:
        if not body["stream"]:
            with pytest.raises(httpx.TimeoutException):  # gives up mid-generation
                await c.post(url, json=body, timeout=rng.uniform(0.05, 1.0))
            return
        async with c.stream("POST", url, json=body) as resp:
            want = rng.randint(0, 4)
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and (want := want - 1) < 0:
                    break  # leaving the block closes the connection mid-stream


def test_random_disconnects_leave_no_kv_in_use(server, client):
    rng = random.Random(0)
    url = server.url + "/v1/completions"

    async def main():
        sem = asyncio.Semaphore(16)

        async def one(i):
            async with sem:
                await _disconnect(url, random.Random(rng.random()))

        await asyncio.gather(*(one(i) for i in range(120)))

    before = server.metrics()['medha_requests_total{status="aborted"}']
    asyncio.run(main())
    after = server.wait_idle()
    assert after["medha_kv_blocks_used"] == 0
    assert after["medha_num_requests_waiting"] == after["medha_num_requests_prefilling"] == 0
    assert after["medha_num_requests_running"] == 0
    assert after['medha_requests_total{status="aborted"}'] - before >= 90
    # and it still serves
    assert (
        client.completions.create(
            model="smollm2", prompt="Still there?", max_tokens=2
        ).usage.completion_tokens
        >= 1
    )


def test_an_async_scheduling_server_answers_as_the_default_one(server, client):
    """`medha serve --async-scheduling` (CUDA's default; its path checked here on a CPU): the
    default server's greedy answers, streamed and not, stops at EOS included (a decode past the
    stop is computed and dropped); random disconnects, some while a batch holding the request
    runs ahead, leave no KV in use; it drains on SIGTERM."""
    ahead = Server("--api-key", KEY, "--prefix-cache", "off", "--async-scheduling")
    try:
        other = openai.OpenAI(base_url=ahead.url + "/v1", api_key=KEY, max_retries=0)
        for prompt in ("Name three colours.", "Why is the sky blue?", "Count to ten:"):
            ask = dict(model="smollm2", prompt=prompt, max_tokens=24, temperature=0)
            want = client.completions.create(**ask).choices[0]
            got = other.completions.create(**ask).choices[0]
            streamed = "".join(
                c.choices[0].text for c in other.completions.create(**ask, stream=True)
            )
            assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
            assert streamed == want.text
        rng = random.Random(1)

        async def main():
            sem = asyncio.Semaphore(8)

            async def one():
                async with sem:
                    await _disconnect(ahead.url + "/v1/completions", random.Random(rng.random()))

            await asyncio.gather(*(one() for _ in range(24)))

        asyncio.run(main())
        after = ahead.wait_idle()
        assert after["medha_kv_blocks_used"] == 0 and after["medha_num_requests_running"] == 0
        assert other.completions.create(model="smollm2", prompt="Still?", max_tokens=2).usage
    finally:
        assert ahead.stop() == 0


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-10, 10**6)
    | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=8,
)
_FIELDS = [
    "model",
    "prompt",
    "messages",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "echo",
    "medha",
    "ignore_eos",
    "stop_token_ids",
    "presence_penalty",
    "max_completion_tokens",
]
_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "bot"]),
            "content": st.one_of(st.text(max_size=30), _JSON),
        }
    ),
    max_size=3,
)


def _no_long_generation(value) -> bool:
    """False for null and for a number a valid max_tokens could be above 4: a fuzzed request
    may then run for minutes on a slow CPU (a chat whose max_tokens is null gets the context's
    room, 8000 tokens, and a fuzzed ignore_eos can keep it from stopping early)."""
    if value is None:
        return False
    return not (isinstance(value, int | float) and not isinstance(value, bool) and value > 4)


# max_tokens for fuzzed bodies: any JSON but a count that takes long (bounded, so valid bodies
# finish quickly on any machine); set on every body, max_completion_tokens dropped
_MAX_TOKENS = st.one_of(st.integers(-2, 4), _JSON.filter(_no_long_generation))


def _bounded(body: dict, max_tokens) -> dict:
    return {k: v for k, v in body.items() if k != "max_completion_tokens"} | {
        "max_tokens": max_tokens
    }


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    body=st.dictionaries(
        st.sampled_from(_FIELDS), st.one_of(_JSON, _MESSAGES, st.text(max_size=40)), max_size=6
    ),
    max_tokens=_MAX_TOKENS,
)
def test_fuzzed_bodies_never_get_5xx(server, path, body, max_tokens):
    body = _bounded(body, max_tokens)
    try:
        r = httpx.post(server.url + path, content=json.dumps(body), headers=AUTH, timeout=30)
    except httpx.ReadTimeout:
        pytest.fail(f"no answer to {body}")
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200 and not body.get("stream"):
        assert "message" in r.json()["error"]


# A greedy stream whose choices are clear: at each of its 16 steps transformers' top two logits
# are at least 4x rounding's bound on their gap apart (medha/testing/numerics.py), so that any
# correct float32 evaluation, in any batch, picks the same tokens. ("The history of the printing
# press begins" has a near-tie at its 9th token: ' ' by 0.045, a bound of 0.051.)
INNOCENT = {
    "prompt": "The capital of France is",
    "max_tokens": 16,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
    "logprobs": 0,  # names each token chosen
}


def _stream_choices(url: str, body: dict = INNOCENT) -> list[dict]:
    """The choices of a streamed completion's events (an error event fails the test)."""
    choices = []
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                choices.append(event["choices"][0])
    return choices


def _stream_text(url: str, body: dict = INNOCENT) -> list[str]:
    """The text chunks of a streamed completion."""
    return [c["text"] for c in _stream_choices(url, body)]


def _tokens(choices: list[dict]) -> list[str]:
    """Each token chosen, decoded alone, from the events' logprobs."""
    return [t for c in choices for t in (c["logprobs"] or {}).get("tokens", [])]


@pytest.fixture(scope="module")
def quiet_stream(server):
    return _stream_text(server.url)


@pytest.fixture(scope="module")
def innocent_reference(server):
    """transformers' greedy continuation of INNOCENT on the server's model, in float32, with
    each step's margin and its rounding bound; and its tokens decoded one by one, as the
    server's logprobs name them."""
    from medha.engine.checkpoint import resolve_model
    from medha.engine.tokenizer import Tokenizer
    from medha.testing.numerics import greedy_reference

    model_dir = resolve_model("smollm2")  # converted by the server, in the test run's cache
    tokenizer = Tokenizer(model_dir)
    ids = tokenizer.encode(INNOCENT["prompt"])
    reference = greedy_reference(model_dir, [ids], INNOCENT["max_tokens"])
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in reference.tokens[0]]
    # each token chosen is named by its text alone: no partial UTF-8 (U+FFFD), no end of text
    assert len(texts) == INNOCENT["max_tokens"] and not any("\ufffd" in t for t in texts), texts
    return reference, texts


def _agrees_with_reference(tokens: list[str], innocent_reference) -> None:
    """The stream's tokens against transformers' greedy ones, by decision
    (numerics.assert_greedy_agrees): the same, or parted only at a step whose reference margin
    is within rounding. A token whose text is not the reference's is another token."""
    from medha.testing.numerics import assert_greedy_agrees

    reference, texts = innocent_reference
    ids = [
        reference.tokens[0][k] if k < len(texts) and text == texts[k] else -1  # -1: another
        for k, text in enumerate(tokens)
    ]
    assert_greedy_agrees([ids], reference)


# The requests that took the service down (issue 13), and the surrogate that got a 500.
KILLERS = [
    (
        "/v1/completions",
        b'{"prompt": "Hi", "max_tokens": 2, "temperature": 1, "top_p": 1e-300}',
        "top_p",
    ),
    (
        "/v1/completions",
        b'{"prompt": "Hi", "max_tokens": 2, "temperature": 1, "top_p": 1e-46}',
        "top_p",
    ),
    ("/v1/completions", b'{"prompt": "Hi", "max_tokens": 2, "temperature": 1e-40}', "temperature"),
    (
        "/v1/completions",
        b'{"prompt": "Hi", "max_tokens": 2, "temperature": 1, "seed": 18446744073709551616}',
        "seed",
    ),
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": "ok \xff\xfe", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": "Hi", "model": "\\udfff"}', "model"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x\\ud800"}]}',
        "messages.0.content",
    ),
    (
        "/v1/completions",
        b'{"prompt": "Hi", "stream_options": {"include_usage": true}}',
        "stream_options",
    ),
    ("/v1/completions", b'{"prompt": "Hi", "best_of": 0}', "best_of"),
    ("/v1/completions", b'{"prompt": "Hi", "echo": true, "logprobs": 1}', "logprobs"),
    ("/v1/completions", b'{"prompt": "Hi", "max_tokens": 2.5}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "Hi", "temperature": "0.5"}', "temperature"),
    ("/v1/completions", b'{"prompt": "Hi", "stop": "' + b"x" * 2000 + b'"}', "stop"),
]


def test_killers_get_4xx_and_leave_others_alone(server, quiet_stream, innocent_reference):
    """Each killer, sent while an innocent request streams: a 400 naming the field, /health
    200 after it, and the innocent request's text as in a quiet run (the killers never reach
    the engine: the innocent runs alone, in the same steps, as the quiet run did)."""
    from concurrent.futures import ThreadPoolExecutor

    _agrees_with_reference(_tokens(_stream_choices(server.url)), innocent_reference)
    with ThreadPoolExecutor(1) as pool:
        for path, raw, param in KILLERS:
            innocent = pool.submit(_stream_text, server.url)
            r = httpx.post(
                server.url + path,
                content=raw,
                headers=AUTH | {"Content-Type": "application/json"},
                timeout=60,
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (raw, r.text)
            assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200
            assert innocent.result() == quiet_stream, raw


def _send_large(url: str, size: int, chunked: bool) -> tuple[int | None, int, float]:
    """POST a JSON prompt of about `size` bytes, generated while it is sent and never finished
    (short of its Content-Length, or without the last chunk); (status, or None when none came
    within 60 s; bytes of the body sent when it came; seconds to it)."""
    import socket
    import threading

    host, port = url.removeprefix("http://").split(":")
    head, tail = b'{"prompt": "', b'"}'
    piece = b"hello world " * 80_000  # ~1 MB
    sock = socket.create_connection((host, int(port)), timeout=60)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
        f"{KEY}\r\nContent-Type: application/json\r\n{framing}\r\n\r\n".encode()
    )
    stop = threading.Event()
    sent = [0]  # bytes of the body handed to the kernel so far

    def send() -> None:
        try:
            for part in (head, *[piece] * ((size - 16) // len(piece)), tail):
                if stop.is_set():
                    return
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
                sent[0] += len(part)
        except OSError:
            pass  # refused and closed: the rest is never read

    t0 = time.perf_counter()
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        status = int(sock.recv(64).split(b" ")[1])
    except TimeoutError:  # no answer: the server waits for the rest of the body
        status = None
    elapsed, sent_then = time.perf_counter() - t0, sent[0]
    stop.set()
    sock.close()
    sender.join(30)
    return status, sent_then, elapsed


def test_large_bodies_get_413_before_they_are_read(server):
    """The answer comes while the sender is still sending: a server that stops reading leaves
    it blocked once the sockets' buffers are full (a few MB on loopback; tens where the kernel
    lets them grow most), far short of the body. A server that read the body first would never
    answer (the body is never finished) or, reading further than it may, late."""
    pid = server.proc.pid
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # peak RSS from here
        peak_from_here = True
    except OSError:  # no clear_refs (gVisor, say): the peak is the process's whole life's
        peak_from_here = False

    def rss(field: str) -> int:
        line = next(
            x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(field)
        )
        return int(line.split()[1]) * 1024

    before = rss("VmRSS")
    for size, chunked in ((400 * 10**6, False), (200 * 10**6, True)):
        status, sent, seconds = _send_large(server.url, size, chunked)
        assert status == 413 and sent < size // 4, (size, chunked, status, sent, seconds)
    if peak_from_here:
        assert rss("VmHWM") - before < 50 * 2**20
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200


_HOSTILE = st.one_of(
    st.sampled_from([raw for _, raw, _ in KILLERS]),
    st.builds(
        lambda b, m: json.dumps(_bounded(b, m)).encode(),
        st.dictionaries(
            st.sampled_from(_FIELDS), st.one_of(_JSON, _MESSAGES, st.text(max_size=40)), max_size=6
        ),
        _MAX_TOKENS,
    ),
    st.builds(
        lambda p, t, s, k: json.dumps(
            {"prompt": p, "max_tokens": 3, "temperature": t, "seed": s, "top_k": k}
        ).encode(),
        st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 60000), max_size=20)),
        st.floats(0, 2),
        st.integers(-(2**64), 2**64),
        st.integers(-3, 2**64),
    ),
    st.binary(max_size=200),
)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    bodies=st.lists(
        st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), _HOSTILE),
        min_size=1,
        max_size=8,
    )
)
def test_hostile_bodies_beside_a_stream_leave_its_tokens_alone(server, innocent_reference, bodies):
    """Valid bodies among the hostile ones share the innocent stream's steps: its rows are then
    computed in larger products than when it runs alone, which sum in another order. So its
    tokens are held to transformers' greedy choices, by decision, not to a quiet run's."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        innocent = pool.submit(_stream_choices, server.url)

        def hostile() -> list[int]:
            return [
                httpx.post(
                    server.url + path,
                    content=raw,
                    headers=AUTH | {"Content-Type": "application/json"},
                    timeout=120,
                ).status_code
                for path, raw in bodies
            ]

        codes = pool.submit(hostile).result()
        assert all(c < 500 for c in codes), (codes, bodies)
        _agrees_with_reference(_tokens(innocent.result()), innocent_reference)
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200


def test_openapi_documents_the_answers(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=TIMEOUT_S).json()
    answers = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert set(answers) == {"200", "400", "401", "404", "413", "429", "500", "503"}
    assert set(answers["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "422" not in json.dumps(doc) and doc["components"]["securitySchemes"]


def _queued(metrics: dict[str, float]) -> float:
    """Requests the engine holds that have no first token yet."""
    return metrics["medha_num_requests_waiting"] + metrics["medha_num_requests_prefilling"]


def test_queue_full_429_then_sigterm_drains():
    s = Server("--max-waiting", "1")
    try:
        url = s.url + "/v1/completions"

        async def queue_full():
            """One request waits for its first token (a 1500-token prompt: a second of prefill
            or more on two threads of the fastest CPU, against milliseconds for three short
            requests to arrive); the three get 429 meanwhile; once it has its token, a request
            gets in."""
            holder = [random.Random(1).randrange(1000, 30000) for _ in range(1500)]
            async with httpx.AsyncClient(timeout=300) as c:
                held = asyncio.create_task(c.post(url, json={"prompt": holder, "max_tokens": 1}))
                deadline = time.monotonic() + 60
                while not _queued(s.metrics()):
                    assert time.monotonic() < deadline and not held.done(), "not admitted"
                    await asyncio.sleep(0.01)
                body = {"prompt": "Hello", "max_tokens": 1}
                burst = await asyncio.gather(*(c.post(url, json=body) for _ in range(3)))
                still_waiting = not held.done()
                held = await held
                return burst, still_waiting, held, await c.post(url, json=body)

        burst, still_waiting, held, after = asyncio.run(queue_full())
        assert still_waiting  # the holder's prefill outlasted the burst, as the sizes make sure
        assert [r.status_code for r in burst] == [429] * 3, [r.text for r in burst]
        assert held.status_code == 200 and after.status_code == 200, (held.text, after.text)
        assert all(r.headers["retry-after"].isdigit() for r in burst)
        assert burst[0].json()["error"]["type"] == "rate_limit_error"

        # SIGTERM while a stream is running: it finishes, then the server exits cleanly
        events = []
        with httpx.stream(
            "POST",
            url,
            json={
                "prompt": "Tell me a story",
                "max_tokens": 40,
                "ignore_eos": True,
                "stream": True,
            },
            timeout=TIMEOUT_S,
        ) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    if not events:
                        s.proc.send_signal(signal.SIGTERM)
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        texts = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert texts[-1]["finish_reason"] == "length"
        assert s.proc.wait(60) == 0
    finally:
        s.stop()


def test_bench_against_the_server(server, tmp_path):
    import csv

    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "medha",
            "bench",
            "--url",
            server.url,
            "--api-key",  # the key meant; $OPENAI_API_KEY would come before $MEDHA_API_KEY
            KEY,
            "--workload",
            "prompt=16-64,output=2-6,long_fraction=0.3,long_prompt=300-400",
            "--long-threshold",
            "300",
            "--qps",
            "8",
            "--num-requests",
            "12",
            "--out",
            str(out),
            "--quiet",
            "--send-slo",  # each request's targets in the medha extension, which it accepts
            "--ttft-slo-per-token-s",
            "0.001",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == {"total": 12, "completed": 12}
    assert summary["client"]["errors"] == 0
    # the classes follow --long-threshold: the trace's prompt lengths say which are long
    rows = list(csv.DictReader((out / "requests.csv").open()))
    long_ = [int(row["num_prefill_tokens"]) >= 300 for row in rows]
    assert 0 < sum(long_) < 12  # the seeded workload has both
    assert [row["request_class"] for row in rows] == ["long" if x else "short" for x in long_]
    by_class = summary["by_class"]
    assert (by_class["long"]["count"], by_class["short"]["count"]) == (sum(long_), 12 - sum(long_))
    # at least 2 tokens each: the end comes a decode step after the first token
    assert 0 < summary["ttft_s"]["p50"] < summary["e2e_s"]["p50"]
    assert (out / "ttft_cdf.png").stat().st_size > 0
    from medha.sim.workload.traces import load_trace

    entries = load_trace(out / "requests.csv")  # a run is a replayable trace
    assert len(entries) == 12 and all(2 <= e.output_len <= 6 for e in entries)
    assert sorted(e.arrival_s for e in entries) == [e.arrival_s for e in entries]


def test_bench_reports_an_unreachable_server(tmp_path):
    import socket

    # a port held, bound but not listening, for the run: connections to it are refused
    # (a port merely free now may be taken by then)
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    with held:
        r = _bench_unreachable(port, tmp_path)
    assert r.returncode == 2 and "cannot reach" in r.stderr
    assert not (tmp_path / "x" / "summary.json").exists()


def _bench_unreachable(port: int, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "medha",
            "bench",
            "--url",
            f"http://127.0.0.1:{port}",
            "--qps",
            "1",
            "--num-requests",
            "2",
            "--out",
            str(tmp_path / "x"),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_slo_fields_reach_the_scheduler_and_engine_failure_gives_503():
    from fastapi.testclient import TestClient

    from medha.engine.llm_engine import EngineConfig, LLMEngine
    from medha.server.app import build_app

    engine = LLMEngine(EngineConfig(kv_memory_gb=0.05))
    seen = []
    add = engine.add_request
    engine.add_request = lambda *a, **kw: (seen.append(kw), add(*a, **kw))[1]
    body = {
        "prompt": "hi",
        "max_tokens": 2,
        "medha": {"priority": "HIGH", "ttft_slo_s": 3, "tpot_slo_s": 0.5},
    }
    with TestClient(build_app(engine)) as c:
        assert c.post("/v1/completions", json=body).status_code == 200
        assert seen[0]["ttft_deadline_s"] == 3 and seen[0]["tpot_target_s"] == 0.5
        assert seen[0]["priority_class"] == "HIGH"

        def lost(*args, **kwargs):  # a device error: fatal whichever request met it
            import torch

            raise torch.AcceleratorError("CUDA error: device lost")

        engine.runner.run = lost
        r = c.post("/v1/completions", json=body)  # in flight when the engine dies
        assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json=body)  # and refused afterwards
        assert r.status_code == 503 and r.headers["retry-after"]
        assert c.get("/health").status_code == 503
        assert engine.scheduler.blocks.num_used == 0


def test_a_request_failing_after_admission_ends_alone(tiny_model):
    """A fault in one request's own work (its sampling row) after admission: that request
    gets a 500 (or an error event mid-stream), the others finish, /health stays 200 and no KV
    is left in use."""
    from fastapi.testclient import TestClient

    from medha.engine import step_modes
    from medha.engine.llm_engine import EngineConfig, LLMEngine
    from medha.server.app import build_app

    engine = LLMEngine(EngineConfig(model=tiny_model, kv_memory_gb=0.01))
    # the four requests share their first step for sure: the engine loop sees nothing to run
    # until all four are in (its thread admits them between steps, as they come)
    added = []
    add, has_unfinished = engine.add_request, engine.has_unfinished
    engine.add_request = lambda *a, **kw: (add(*a, **kw), added.append(a[0]))[0]
    engine.has_unfinished = lambda: len(added) >= 4 and has_unfinished()
    real = step_modes.finish_sampling
    poisoned = {"victim": None}

    def finish_sampling(started, rows, params, generators, request_ids):
        if poisoned["victim"] is None and len(request_ids) > 1:
            poisoned["victim"] = request_ids[0]  # the first row of the first shared batch
        if poisoned["victim"] in request_ids:
            # what a NaN anywhere in the victim's logits makes of its row's largest (sampler.py)
            started.wait()
            started.host[0, rows[request_ids.index(poisoned["victim"])]] = float("nan")
        return real(started, rows, params, generators, request_ids)

    step_modes.finish_sampling = finish_sampling
    try:
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        with TestClient(build_app(engine)) as c:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(4) as pool:
                results = list(
                    pool.map(
                        lambda s: c.post("/v1/completions", json=body | {"stream": s}),
                        [False, True, False, True],
                    )
                )
            failed = [r for r in results if r.status_code == 500 or "server_error" in r.text]
            assert len(failed) == 1, [r.text[:200] for r in results]
            assert "non-finite logits" in failed[0].text
            ok = [r for r in results if r is not failed[0]]
            assert all(r.status_code == 200 and "server_error" not in r.text for r in ok)
            assert c.get("/health").status_code == 200
            assert engine.scheduler.blocks.num_used == 0
            metrics = c.get("/metrics").text
            assert 'medha_requests_total{status="failed"} 1.0' in metrics
    finally:
        step_modes.finish_sampling = real


def test_bench_long_threshold_follows_the_models_max_model_len():
    from medha.benchmark.config import BenchConfig
    from medha.benchmark.load_generator import long_threshold

    card = {"id": "smollm2", "max_model_len": 8192}
    assert long_threshold(BenchConfig(), card) == (2048, "server max_model_len")
    assert long_threshold(BenchConfig(long_threshold=300), card) == (300, "flag")
    assert long_threshold(BenchConfig(), {"id": "other"}) == (32768, "default")


# ---- what bytes may enter, at the ASGI level (no server) -----------------------------------
def test_integers_may_be_written_with_a_zero_fraction_as_the_document_says():
    """The OpenAPI document says integer; JSON Schema counts 1.0 as one (schemathesis sends it)."""
    from pydantic import ValidationError

    from medha.server.protocol import ChatCompletionRequest, CompletionRequest

    r = CompletionRequest.model_validate_json(
        b'{"prompt": [1.0, 2], "n": 1.0, "max_tokens": 2.0, "seed": 7.0, "logprobs": 0.0}'
    )
    assert (r.prompt, r.n, r.max_tokens, r.seed, r.logprobs) == ([1, 2], 1, 2, 7, 0)
    assert type(r.max_tokens) is int
    chat = ChatCompletionRequest.model_validate_json(
        b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3.0}'
    )
    assert chat.max_completion_tokens == 3
    for raw in (
        b'{"prompt": "Hi", "max_tokens": 2.5}',
        b'{"prompt": "Hi", "n": 2.0}',  # an integer, and refused as n > 1 is
        b'{"prompt": "Hi", "max_tokens": true}',
        b'{"prompt": "Hi", "max_tokens": "2"}',
        b'{"prompt": "Hi", "max_tokens": 1e400}',
        b'{"prompt": [1.5]}',
    ):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate_json(raw)


def test_bodies_in_flight_are_capped_in_all():
    """Bodies buffered at once may not pass max_buffered_bytes: the one that would gets 429
    with Retry-After; the bytes of a finished or refused body are let go."""
    from medha.server.body_guard import BodyGuard

    async def app(scope, receive, send):  # echoes the body's length
        message = await receive()
        body = str(len(message["body"])).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    guard = BodyGuard(app, max_bytes=80, max_buffered_bytes=100)

    async def post(pieces, gate=None, length=None):
        """Send `pieces`, waiting on `gate` before the last; (status, headers, body)."""
        queue = list(pieces)
        sent = []

        async def receive():
            piece = queue.pop(0)
            if not queue and gate is not None:
                await gate.wait()
            return {"type": "http.request", "body": piece, "more_body": bool(queue)}

        async def send(message):
            sent.append(message)

        headers = [] if length is None else [(b"content-length", str(length).encode())]
        scope = {"type": "http", "method": "POST", "headers": headers}
        await guard(scope, receive, send)
        start = sent[0]
        return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent)

    async def scenario():
        gate = asyncio.Event()
        slow = asyncio.create_task(post([b"a" * 60, b"b" * 10], gate))
        await asyncio.sleep(0)  # it holds 60 bytes, waiting to send its last piece
        assert guard.buffered == 60
        status, headers, _ = await post([b"c" * 30, b"d" * 20])  # 60 + 50 > 100
        assert status == 429 and headers[b"retry-after"] == b"1"
        assert guard.buffered == 60  # the refused body's 30 bytes were let go
        status, _, _ = await post([b"e" * 50], length=50)  # refused by its Content-Length
        assert status == 429
        assert (await post([b"f" * 40]))[0] == 200  # 60 + 40 fits
        gate.set()
        assert (await slow)[2] == b"70"
        assert guard.buffered == 0
        assert (await post([b"g" * 80]))[2] == b"80"
        assert (await post([b"h" * 81]))[0] == 413  # over the body limit: 413, not 429

    asyncio.run(scenario())


def test_body_limits_are_checked():
    from medha.server.config import ServerConfig, max_buffered_bytes

    assert max_buffered_bytes(ServerConfig(max_request_bytes=1000), 8192) == 16_000
    assert max_buffered_bytes(ServerConfig(), 8192) == 16 * (64 * 8192 + (1 << 20))
    with pytest.raises(ValueError, match="must be at least the body limit"):
        max_buffered_bytes(ServerConfig(max_request_bytes=1000, max_buffered_bytes=999), 8192)
    with pytest.raises(ValueError, match="must be a positive integer"):
        max_buffered_bytes(ServerConfig(max_buffered_bytes=0), 8192)


def test_serve_times_the_start_up_probe_and_generate_does_not(tiny_model):
    """`medha serve` plans the arrivals to come: with no profile and the online correction, its
    engine times the start-up probe before /health answers (docs/design.md, "Start-up probe and
    profile"); `medha generate` runs what it is given at once and times none."""
    server = Server("--model", str(tiny_model), "--calibrate", "online")
    assert server.stop() == 0
    assert "corrected by 6 probe shapes" in server.proc.stdout.read()
    flags = ["--model", str(tiny_model), "--calibrate", "online", "--dtype", "float32"]
    generate = subprocess.run(
        [sys.executable, "-m", "medha", "generate", *flags, "--prompt", "hi", "--max-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert generate.returncode == 0, generate.stderr
    assert "probe shapes" not in generate.stderr
