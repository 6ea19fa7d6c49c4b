"""`medha serve --engine vllm`: medha's HTTP server over vLLM's `AsyncLLM`.

The server reads an engine through two faces (medha/server/state.py): `EngineLike`, its facts
and tokenizing, and `AsyncEngineLike`, which admits and aborts requests and streams their
outputs. Here both are built over `AsyncLLM`, the object vLLM's own OpenAI server drives: its
engine core (with `MedhaScheduler` deciding every step) runs in a process of its own, and its
output handler, a task on the server's event loop, detokenizes and applies stop strings, so
the front end costs what vLLM's does and an abort reaches the engine core at once.

What medha keeps: the API, its validation and its errors, the tokenizer and chat template
(prompts reach vLLM as token ids), the admission checks of medha's engine (context, KV cache
capacity: a 400 naming the field before vLLM sees the request), the bound on requests waiting
for their first token (429), and the metrics. What vLLM does: sampling, seeds, stop strings
and stop token ids, EOS, logprobs and detokenizing, from medha's `SamplingParams` mapped to
vLLM's (`vllm_sampling_params`); a request's medha targets travel in its `extra_args`, where
`MedhaScheduler` reads them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from vllm import SamplingParams as VllmSamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs.engine import tokens_input
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError
from vllm.v1.metrics.loggers import StatLoggerBase

from medha.core.config import parse_chunking
from medha.core.request import Request
from medha.engine.config import EngineConfig
from medha.engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from medha.engine.layers.sampler import Sample
from medha.engine.llm_engine import EngineStats, check_prompt
from medha.engine.outputs import RequestOutput
from medha.engine.sampling_params import SamplingParams
from medha.engine.tokenizer import Tokenizer
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.packers import PACKERS
from medha.server.async_engine import QueueFullError
from medha.server.metrics import ServerMetrics
from medha.vllm_executor.engine_args import vllm_engine_args
from medha.vllm_executor.scheduler import TARGETS  # extra_args key -> medha Request field

log = logging.getLogger("medha.server")

# vLLM's finish reasons that end a request well, as the API names them (repetition: vLLM's
# optional repetition detection stopped it)
_FINISHED = {"stop": "stop", "length": "length", "repetition": "stop"}


class VllmEngine:
    """vLLM's `AsyncLLM` running medha's scheduler, with the facts the server reads.

    Build it inside the event loop that will serve (as vLLM's own server does): the engine core
    starts in a process of its own, which takes a while; the output handler then runs as a task
    of this loop."""

    def __init__(
        self, config: EngineConfig, scheduler: SchedulerConfig, vllm_args: dict | None = None
    ) -> None:
        # nobody calls vLLM's periodic log of its own stats here: leave its default loggers out
        # (the Prometheus one of vLLM stays, as in vLLM's server); our step logger keeps what
        # /metrics shows
        kwargs = vllm_engine_args(
            config, scheduler, {"disable_log_stats": True} | (vllm_args or {})
        )
        self.config = config
        self.step_stats = _StepStats()
        self.llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(**kwargs), stat_loggers=[lambda vllm_config, index: self.step_stats]
        )
        vc = self.llm.vllm_config
        self.tokenizer = Tokenizer(Path(kwargs["model"]))
        self.max_model_len = vc.model_config.max_model_len
        self.vocab_size = vc.model_config.get_vocab_size()
        # vLLM keeps one block aside (the null block); medha's mirror has the rest, and so
        # does this: a request that cannot fit them is refused here, not in the engine core
        self.num_kv_blocks = vc.cache_config.num_gpu_blocks - 1
        self.kv_capacity_tokens = self.num_kv_blocks * vc.cache_config.block_size
        self.device = vc.device_config.device_type
        self.dtype = str(vc.model_config.dtype).removeprefix("torch.")
        self.chunking = scheduler.chunking
        self.policy = (
            scheduler.policy or PACKERS.get(parse_chunking(self.chunking)[0]).default_policy
        )
        self.awaiting_first_token = 0  # admitted by the server, no token yet (VllmAsyncEngine)

    def encode_prompt(self, text: str, param: str = "prompt") -> list[int]:
        return self.tokenizer.encode(text, param, limit=self.max_model_len)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, limit=self.max_model_len)

    def check_request(self, prompt_ids: list[int], params: SamplingParams, slo: dict) -> None:
        """medha's engine's admission checks (InvalidRequestError or ValueError naming the
        field), which MedhaScheduler's mirror would otherwise fail inside the engine core."""
        check_prompt(prompt_ids, self.max_model_len, self.vocab_size)
        Request("check", 0.0, len(prompt_ids), params.max_tokens, **slo).validate(
            self.max_model_len
        )
        total = len(prompt_ids) + params.max_tokens
        if total > self.kv_capacity_tokens:
            raise ValueError(
                f"prompt_len + max_tokens = {total} exceeds the KV cache "
                f"capacity of {self.kv_capacity_tokens} tokens"
            )

    def stats(self) -> EngineStats:
        """From vLLM's scheduler stats of the latest step. vLLM counts a request running from
        its first scheduled chunk on: those of them still without a token are prefilling."""
        s = self.step_stats.latest
        if s is None:  # no step yet
            return EngineStats(0, 0, 0, 0, 0, self.num_kv_blocks, 0)
        waiting = s.num_waiting_reqs + s.num_skipped_waiting_reqs
        prefilling = min(max(self.awaiting_first_token - waiting, 0), s.num_running_reqs)
        used = round(s.kv_cache_usage * self.num_kv_blocks)
        return EngineStats(
            waiting=waiting,
            prefilling=prefilling,
            running=s.num_running_reqs - prefilling,
            swapped=0,  # medha preempts by recompute on vLLM
            kv_blocks_used=used,
            kv_blocks_free=self.num_kv_blocks - used,
            preemptions=self.step_stats.preemptions,
        )

    def shutdown(self) -> None:
        self.llm.shutdown()


class _StepStats(StatLoggerBase):
    """vLLM's stat logger interface, called on the event loop with each step's outputs: keeps
    the latest scheduler stats and counts preemptions. `on_step` gets the time between two
    steps' outputs while vLLM had requests: its step time, as the server sees it."""

    def __init__(self) -> None:
        self.latest = None  # vLLM's SchedulerStats
        self.preemptions = 0
        self.on_step = None
        self._last_s: float | None = None  # when the previous step's outputs came, if busy

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        now = time.perf_counter()
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs
        if scheduler_stats is None:
            return
        if self._last_s is not None and self.on_step is not None:
            self.on_step(now - self._last_s)
        self.latest = scheduler_stats
        busy = scheduler_stats.num_running_reqs + scheduler_stats.num_waiting_reqs
        self._last_s = now if busy else None

    def log_engine_initialized(self) -> None:
        pass


def vllm_sampling_params(params: SamplingParams, slo: dict) -> VllmSamplingParams:
    """medha's sampling parameters (validated already) as vLLM's, with outputs as deltas and
    the request's medha targets (`slo`: the Request fields) in `extra_args`."""
    targets = {key: slo[name] for key, name in TARGETS.items() if slo.get(name) is not None}
    return VllmSamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        output_kind=RequestOutputKind.DELTA,
        extra_args=targets or None,
    )


class VllmAsyncEngine:
    """The server's way to run requests on a `VllmEngine` (see medha/server/state.py)."""

    def __init__(self, engine: VllmEngine, metrics: ServerMetrics, max_waiting: int) -> None:
        self.engine = engine
        self.llm = engine.llm
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._live: dict[str, _Outputs] = {}  # admitted, not ended (by id)
        self._aborts: set[asyncio.Task] = set()  # vLLM aborts in flight (kept from the GC)
        engine.step_stats.on_step = metrics.iteration.observe

    @property
    def dead(self) -> str | None:
        if self.llm.errored:
            return "vLLM's engine core stopped (its log says why)"
        return None

    def start(self) -> None:
        """Nothing to start: the engine core runs since VllmEngine was built."""

    def stop(self) -> None:
        self.engine.shutdown()

    async def add(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, **slo
    ) -> _Outputs:
        if self.dead:
            raise EngineDeadError(self.dead)
        self.engine.check_request(prompt_ids, params, slo)
        if self.engine.awaiting_first_token >= self.max_waiting:
            raise QueueFullError(
                f"{self.engine.awaiting_first_token} requests are waiting (--max-waiting)"
            )
        # counted before the first await, so that a burst cannot slip past the bound
        self.engine.awaiting_first_token += 1
        outputs = _Outputs(self, request_id, prompt_ids, params.logprobs)
        try:
            outputs.collector = await self.llm.add_request(
                request_id, tokens_input(prompt_ids), vllm_sampling_params(params, slo)
            )
        except BaseException as e:
            self.engine.awaiting_first_token -= 1
            if isinstance(e, VllmEngineDeadError):
                raise EngineDeadError(self.dead or "vLLM's engine core stopped") from None
            if isinstance(e, VLLMClientError):  # vLLM's own validation: the request's fault
                raise InvalidRequestError(str(e), getattr(e, "parameter", None)) from None
            raise
        self._live[request_id] = outputs
        return outputs

    def abort(self, request_id: str) -> None:
        outputs = self._live.get(request_id)
        if outputs is None:
            return
        self._end(outputs)
        self.metrics.requests.labels("aborted").inc()
        self._abort_in_vllm(request_id)

    def _abort_in_vllm(self, request_id: str) -> None:
        """vLLM's abort (frees the request's KV in the engine core), from synchronous code."""
        task = asyncio.ensure_future(self.llm.abort(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._abort_done)

    def _abort_done(self, task: asyncio.Task) -> None:
        self._aborts.discard(task)
        if not task.cancelled() and task.exception() is not None:  # a dead engine core: no KV
            log.debug("vLLM's abort failed: %s", task.exception())

    def _end(self, outputs: _Outputs) -> None:
        if self._live.pop(outputs.request_id, None) is not None and outputs.first_s is None:
            self.engine.awaiting_first_token -= 1

    def _output(self, outputs: _Outputs, out) -> RequestOutput:
        """vLLM's delta output (one or more steps' worth) as medha's."""
        completion = out.outputs[0]
        new = list(completion.token_ids)
        now = time.monotonic()
        if outputs.first_s is None and new:
            outputs.first_s = now
            self.engine.awaiting_first_token -= 1
        outputs.token_ids.extend(new)
        outputs.text += completion.text
        if getattr(out, "num_cached_tokens", None):
            outputs.cached_tokens = out.num_cached_tokens
        finished = out.finished
        reason = completion.finish_reason
        if finished and reason not in _FINISHED:  # vLLM's "error", or an abort of its own
            raise RequestFailedError(outputs.request_id, f"vLLM finished it ({reason})")
        result = RequestOutput(
            request_id=outputs.request_id,
            new_token_ids=new,
            delta_text=completion.text,
            text=outputs.text,
            token_ids=list(outputs.token_ids) if finished else None,
            finished=finished,
            finish_reason=_FINISHED[reason] if finished else None,
            prompt_token_ids=outputs.prompt_ids,
            logprobs=_samples(new, completion.logprobs, outputs.logprobs)
            if outputs.logprobs is not None
            else None,
            metrics=outputs.metrics(now) if finished else None,
        )
        if finished:
            self._end(outputs)
            self.metrics.finished(result)
        return result

    def _failed(self, outputs: _Outputs, error: Exception) -> Exception:
        """What ends a request that vLLM failed (or the engine core with it)."""
        if isinstance(error, VllmEngineDeadError) or self.llm.errored:
            error = EngineDeadError(self.dead or "vLLM's engine core stopped")
        else:
            if not isinstance(error, RequestFailedError):
                error = RequestFailedError(outputs.request_id, error)
            log.warning("%s", error)
            self._abort_in_vllm(outputs.request_id)  # if vLLM still runs it
        if outputs.request_id in self._live:
            self._end(outputs)
            self.metrics.requests.labels("failed").inc()
        return error


class _Outputs:
    """One request's outputs as the server reads them (`await get()`): medha RequestOutputs
    made from vLLM's deltas as they are read (vLLM merges the deltas of steps not read yet),
    then None; or the exception that ended the request."""

    def __init__(
        self, async_engine: VllmAsyncEngine, request_id: str, prompt_ids: list[int], logprobs
    ) -> None:
        self.async_engine, self.request_id, self.prompt_ids = async_engine, request_id, prompt_ids
        self.logprobs: int | None = logprobs
        self.collector = None  # vLLM's RequestOutputCollector
        self.arrival_s = time.monotonic()
        self.first_s: float | None = None
        self.text = ""
        self.token_ids: list[int] = []
        self.cached_tokens = 0  # prompt tokens vLLM's prefix cache supplied
        self.ended = False

    async def get(self):
        if self.ended:
            return None
        try:
            out = self.collector.get_nowait() or await self.collector.get()
            result = self.async_engine._output(self, out)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.ended = True
            return self.async_engine._failed(self, e)
        self.ended = result.finished
        return result

    def metrics(self, now: float) -> dict:
        """The finished request's metrics, as medha's engine reports them (the server's
        clock: arrival is when the server admitted it, token times when it read them)."""
        n = len(self.token_ids)
        first = self.first_s if self.first_s is not None else now
        return {
            "ttft_s": first - self.arrival_s,
            "e2e_s": now - self.arrival_s,
            "tpot_s": (now - first) / (n - 1) if n > 1 else None,
            "prompt_tokens": len(self.prompt_ids),
            "cached_prompt_tokens": self.cached_tokens,
            "completion_tokens": n,
        }


def _samples(tokens: list[int], logprobs, top: int) -> list[Sample]:
    """vLLM's logprobs of each sampled token (a dict: the sampled token, then the `top`
    likeliest, with their ranks) as medha's Samples. Both are the model's own distribution,
    before temperature and cuts (vLLM's default logprobs mode, raw_logprobs)."""
    samples = []
    for token, entries in zip(tokens, logprobs or ()):
        ranked = sorted(
            (lp.rank, t, lp.logprob)
            for t, lp in entries.items()
            if lp.rank is not None and lp.rank <= top
        )
        samples.append(Sample(token, entries[token].logprob, [(t, lp) for _, t, lp in ranked]))
    return samples
