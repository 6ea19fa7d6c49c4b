"""The blocking interface: LLM(model=...).generate(prompts, sampling_params)."""

from __future__ import annotations

import itertools

from tqdm import tqdm

from medha.engine.config import EngineConfig, resolve_start_probe
from medha.engine.llm_engine import LLMEngine
from medha.engine.outputs import RequestOutput
from medha.engine.sampling_params import SamplingParams
from medha.scheduler.config import SchedulerConfig


class LLM:
    def __init__(
        self, model: str = "smollm2", scheduler: SchedulerConfig | None = None, **engine_options
    ) -> None:
        # what it runs is given at once: no start-up probe unless asked for
        start_probe = engine_options.get("start_probe")
        engine_options["start_probe"] = resolve_start_probe(start_probe, plans_arrivals=False)
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options), scheduler)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched by the scheduler; outputs in input order.

        All or nothing: a prompt the engine refuses raises ValueError (InvalidRequestError
        names the field) and none of the call's prompts runs. A request that fails on its own
        once running comes back finished with finish_reason "error" and the message in
        `error`; the others are unaffected. Whatever happens, the call leaves nothing behind in
        the engine."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params or SamplingParams()] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        final: dict[str, RequestOutput] = {}
        logprobs: dict[str, list] = {rid: [] for rid in ids}
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(rid, prompt, p)
            with tqdm(total=len(ids), disable=not use_tqdm, unit="req") as bar:
                while len(final) < len(ids):
                    for out in self.engine.step():
                        if out.request_id not in logprobs:
                            continue  # a request of an earlier call that ended meanwhile
                        if out.logprobs:
                            logprobs[out.request_id].extend(out.logprobs)
                        if out.finished:
                            out.logprobs = logprobs[out.request_id] or out.logprobs
                            final[out.request_id] = out
                            bar.update(1)
        finally:  # refused, interrupted or failed: the call's requests end with it
            for rid in ids:
                if rid not in final:
                    self.engine.abort(rid)
        return [final[rid] for rid in ids]

    def chat(
        self, messages: list[dict], sampling_params: SamplingParams | None = None
    ) -> RequestOutput:
        return self.generate([self.engine.encode_chat(messages)], sampling_params)[0]
