"""The stub backend (medha/benchmark/stub_backend.py) that `medha route`'s benchmark and tests
put behind the router: its answers are valid OpenAI bodies and its fault knobs do what they
say. Most tests drive the ASGI app in process (torch-free, milliseconds); one starts it as the
subprocess the router's tests use, for the knobs that need a real connection."""

import asyncio
import json

import httpx
import pytest

from medha.benchmark.stub_backend import Knobs, StubApp, _Drop, _knob_flags, stub_backend


def call(app: StubApp, method: str, path: str, body: dict | None = None) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://stub") as c:
            return await c.request(method, path, json=body)

    return asyncio.run(go())


def events(resp: httpx.Response) -> list:
    lines = [ln[len("data: ") :] for ln in resp.text.split("\n\n") if ln]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_answers():
    app = StubApp(Knobs(model="m", n_tokens=3))
    assert call(app, "GET", "/health").status_code == 200
    assert call(app, "GET", "/v1/models").json()["data"][0]["id"] == "m"
    out = call(app, "POST", "/v1/completions", {"prompt": "x" * 40}).json()
    assert out["object"] == "text_completion" and out["choices"][0]["text"] == " tok" * 3
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    msgs = [{"role": "user", "content": "y" * 8}]
    out = call(app, "POST", "/v1/chat/completions", {"messages": msgs}).json()
    assert out["choices"][0]["message"] == {"role": "assistant", "content": " tok" * 3}
    assert out["usage"]["prompt_tokens"] == 2
    chunks = events(call(app, "POST", "/v1/completions", {"prompt": "a", "stream": True}))
    assert [c["choices"][0]["text"] for c in chunks] == [" tok"] * 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    body = {"messages": msgs, "stream": True, "stream_options": {"include_usage": True}}
    chunks = events(call(app, "POST", "/v1/chat/completions", body))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert call(app, "GET", "/stub/stats").json() == {"requests": 4}
    assert call(app, "GET", "/nowhere").status_code == 404


def test_knobs_at_run_time():
    app = StubApp()
    assert call(app, "POST", "/stub/config", {"status": 429}).json()["status"] == 429
    r = call(app, "POST", "/v1/completions", {"prompt": "a"})
    assert r.status_code == 429 and r.json()["error"]["code"] == 429
    assert call(app, "GET", "/health").status_code == 200  # faults hit generation only
    assert call(app, "POST", "/stub/config", {"nope": 1}).status_code == 400
    assert call(app, "POST", "/stub/config", {"delay_s": "1"}).status_code == 400
    assert call(app, "POST", "/stub/config", {"status": 0, "die_after_tokens": 1}).is_success
    with pytest.raises(_Drop):  # uvicorn closes the connection on it
        call(app, "POST", "/v1/completions", {"prompt": "a", "stream": True})
    config = call(app, "POST", "/stub/config", {"reset_stats": True, "delay_s": 1}).json()
    assert config["delay_s"] == 1.0 and call(app, "GET", "/stub/stats").json()["requests"] == 0


def test_flags_round_trip():
    assert _knob_flags(Knobs(hang=True, delay_s=0.5)) == ["--delay-s", "0.5", "--hang"]


def test_subprocess_faults():
    """The knobs that need a real connection: a dropped stream, a hang, an exiting process."""
    with stub_backend(n_tokens=4, with_process=True) as (url, proc):
        c = httpx.Client(base_url=url, timeout=5)
        assert c.post("/v1/completions", json={"prompt": "a"}).status_code == 200
        c.post("/stub/config", json={"die_after_tokens": 2})
        with pytest.raises(httpx.RemoteProtocolError):
            c.post("/v1/completions", json={"prompt": "a", "stream": True})
        assert c.get("/health").status_code == 200  # the process lives on
        c.post("/stub/config", json={"die_after_tokens": None, "hang": True})
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={"prompt": "a"}, timeout=0.3)
        c.post("/stub/config", json={"hang": False, "exit_after_tokens": 1})
        with pytest.raises(httpx.RemoteProtocolError):
            c.post("/v1/completions", json={"prompt": "a", "stream": True})
        assert proc.wait(5) == 1
