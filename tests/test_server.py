"""The OpenAI-compatible server, started for real in a subprocess and driven with the official
openai client and httpx."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from medha.utils.net import free_port

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Server:
    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "medha", "serve", "--port", str(self.port),
             "--log-level", "warning", "--kv-memory-gb", "0.25", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 240  # first start converts the embedded model
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: "
                                   f"{self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.proc.kill()
        raise RuntimeError("server did not come up")

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 60) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = m["medha_kv_blocks_used"] + m["medha_num_requests_waiting"] + \
                m["medha_num_requests_running"]
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
    s = Server("--api-key", KEY)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12,
                                          temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 12 or full.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        full.choices[0].finish_reason


def test_completions_stream_equals_non_stream(client):
    full = client.completions.create(model="smollm2", prompt="Once upon a time",
                                     max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 10
    parts = list(client.completions.create(model="smollm2", prompt="Once upon a time",
                                           max_tokens=10, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in parts) == full.choices[0].text


def test_token_prompts_batches_echo_and_logprobs(client):
    out = client.completions.create(model="smollm2", prompt=["Hello", "Good morning"],
                                    max_tokens=2, temperature=0, echo=True)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[1].text.startswith("Good morning")
    out = client.completions.create(model="smollm2", prompt=[504, 3575, 282], max_tokens=4,
                                    temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(t) == 2 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    # greedy: the chosen token is the likeliest
    assert all(lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()))
               for i in range(4))
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=3)
    assert all(len(t.top_logprobs) == 3 for t in chat.choices[0].logprobs.content)


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="smollm2", prompt="The weather today", max_tokens=8, temperature=1.0,
              top_p=0.9, seed=7)
    assert client.completions.create(**kw).choices[0].text == \
        client.completions.create(**kw).choices[0].text


def test_slo_fields_are_accepted(client):
    out = client.completions.create(
        model="smollm2", prompt="Hi", max_tokens=2,
        extra_body={"medha": {"priority": "HIGH", "ttft_slo_s": 2.0, "tpot_slo_s": 0.5}})
    assert out.usage.completion_tokens >= 1


@pytest.mark.parametrize("path,body,status,param", [
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
    ("/v1/completions", {"prompt": "hi", "medha": {"ttft_slo_s": 0}}, 400,
     "medha.ttft_slo_s"),
    ("/v1/completions", {"prompt": "hi", "medha": {"priority": "URGENT"}}, 400,
     "medha.priority"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 9000}, 400, "max_tokens"),
])
def test_invalid_requests_get_openai_errors(server, path, body, status, param):
    r = httpx.post(server.url + path, json=body, headers=AUTH)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]


def test_malformed_json_and_auth(server):
    for content_type in ("application/json", "text/plain"):
        r = httpx.post(server.url + "/v1/completions", content=b"{not json",
                       headers=AUTH | {"Content-Type": content_type})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope").models.list()


def test_metrics_count_requests_and_latencies(server, client):
    before = server.metrics()
    client.completions.create(model="smollm2", prompt="Count", max_tokens=3)
    httpx.post(server.url + "/v1/completions", json={"prompt": ""}, headers=AUTH)
    after = server.wait_idle()
    assert after['medha_requests_total{status="ok"}'] == \
        before['medha_requests_total{status="ok"}'] + 1
    assert after['medha_requests_total{status="invalid"}'] >= \
        before['medha_requests_total{status="invalid"}'] + 1
    assert after["medha_time_to_first_token_seconds_count"] == \
        before["medha_time_to_first_token_seconds_count"] + 1
    assert after["medha_iteration_seconds_count"] > before["medha_iteration_seconds_count"]
    assert after["medha_kv_blocks_total"] > 0 and after["medha_kv_blocks_used"] == 0


async def _disconnect(url: str, rng: random.Random) -> None:
    body = {"prompt": [rng.randrange(1000, 30000) for _ in range(rng.randint(8, 300))],
            "max_tokens": 200, "ignore_eos": True, "stream": rng.random() < 0.8}
    async with httpx.AsyncClient(headers=AUTH, timeout=30) as c:
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
        await asyncio.gather(*(one(i) for i in range(200)))
    before = server.metrics()['medha_requests_total{status="aborted"}']
    asyncio.run(main())
    after = server.wait_idle()
    assert after["medha_kv_blocks_used"] == 0
    assert after["medha_num_requests_waiting"] == 0 and after["medha_num_requests_running"] == 0
    assert after['medha_requests_total{status="aborted"}'] - before >= 150
    # and it still serves
    assert client.completions.create(model="smollm2", prompt="Still there?",
                                     max_tokens=2).usage.completion_tokens >= 1


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-10, 10**6) |
                     st.floats(allow_nan=True) | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) |
                     st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=8)
_FIELDS = ["model", "prompt", "messages", "temperature", "top_p", "top_k", "n", "stop", "seed",
           "stream", "stream_options", "logprobs", "top_logprobs", "echo", "medha",
           "ignore_eos", "stop_token_ids", "presence_penalty", "max_completion_tokens"]
_MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "bot"]),
     "content": st.one_of(st.text(max_size=30), _JSON)}), max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       body=st.dictionaries(st.sampled_from(_FIELDS),
                            st.one_of(_JSON, _MESSAGES, st.text(max_size=40)), max_size=6),
       max_tokens=st.one_of(st.integers(-2, 4), _JSON))
def test_fuzzed_bodies_never_get_5xx(server, path, body, max_tokens):
    body["max_tokens"] = max_tokens  # bounded, so valid bodies finish quickly
    body.pop("max_completion_tokens", None)
    try:
        r = httpx.post(server.url + path, content=json.dumps(body), headers=AUTH, timeout=30)
    except httpx.ReadTimeout:
        pytest.fail(f"no answer to {body}")
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200 and not body.get("stream"):
        assert "message" in r.json()["error"]


def test_queue_full_429_then_sigterm_drains():
    s = Server("--max-waiting", "1")
    try:
        url = s.url + "/v1/completions"
        prompt = [random.Random(1).randrange(1000, 30000) for _ in range(1500)]

        async def burst():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*(c.post(url, json={"prompt": prompt,
                                                                "max_tokens": 1})
                                              for _ in range(4)))
        codes = sorted(r.status_code for r in asyncio.run(burst()))
        assert codes[0] == 200 and codes[-1] == 429
        rejected = [r for r in asyncio.run(burst()) if r.status_code == 429]
        assert rejected and rejected[0].headers["retry-after"].isdigit()
        assert rejected[0].json()["error"]["type"] == "rate_limit_error"

        # SIGTERM while a stream is running: it finishes, then the server exits cleanly
        events = []
        with httpx.stream("POST", url, json={"prompt": "Tell me a story", "max_tokens": 40,
                                             "ignore_eos": True, "stream": True}) as resp:
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
    out = tmp_path / "run"
    env = os.environ | {"MEDHA_API_KEY": KEY}
    r = subprocess.run([sys.executable, "-m", "medha", "bench", "--url", server.url,
                        "--workload", "prompt=16-64,output=2-6,long_fraction=0.3,"
                        "long_prompt=300-400", "--long-threshold", "300", "--qps", "8",
                        "--num-requests", "12", "--out", str(out), "--quiet"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == {"total": 12, "completed": 12}
    assert summary["client"]["errors"] == 0
    by_class = summary["by_class"]
    assert by_class["short"]["count"] + by_class["long"]["count"] == 12
    assert 0 < summary["ttft_s"]["p50"] <= summary["e2e_s"]["p50"]
    assert (out / "ttft_cdf.png").stat().st_size > 0
    from medha.sim.workload.traces import load_trace
    entries = load_trace(out / "requests.csv")  # a run is a replayable trace
    assert len(entries) == 12 and all(2 <= e.output_len <= 6 for e in entries)
    assert sorted(e.arrival_s for e in entries) == [e.arrival_s for e in entries]


def test_bench_reports_an_unreachable_server(tmp_path):
    r = subprocess.run([sys.executable, "-m", "medha", "bench", "--url",
                        f"http://127.0.0.1:{free_port()}", "--qps", "1", "--num-requests",
                        "2", "--out", str(tmp_path / "x"), "--quiet"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot reach" in r.stderr
    assert not (tmp_path / "x" / "summary.json").exists()


def test_slo_fields_reach_the_scheduler_and_engine_failure_gives_503():
    from fastapi.testclient import TestClient

    from medha.engine.llm_engine import EngineConfig, LLMEngine
    from medha.server.api_server import build_app

    engine = LLMEngine(EngineConfig(kv_memory_gb=0.05))
    seen = []
    add = engine.add_request
    engine.add_request = lambda *a, **kw: (seen.append(kw), add(*a, **kw))[1]
    body = {"prompt": "hi", "max_tokens": 2,
            "medha": {"priority": "HIGH", "ttft_slo_s": 3, "tpot_slo_s": 0.5}}
    with TestClient(build_app(engine)) as c:
        assert c.post("/v1/completions", json=body).status_code == 200
        assert seen[0]["ttft_deadline_s"] == 3 and seen[0]["tpot_target_s"] == 0.5
        assert seen[0]["priority_class"] == "HIGH"

        def lost(*args, **kwargs):
            raise RuntimeError("device lost")
        engine.runner.execute = lost
        r = c.post("/v1/completions", json=body)  # in flight when the engine dies
        assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json=body)  # and refused afterwards
        assert r.status_code == 503 and r.headers["retry-after"]
        assert c.get("/health").status_code == 503
        assert engine.scheduler.blocks.num_used == 0
