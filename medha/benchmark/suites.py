"""The registry of bench/'s suites: each script's name, its folder (its subject) and what it
measures; bench/run.py lists and runs them from here, bench/tables.py finds its commands'
scripts here, and bench/README.md has a line for each (tests/test_bench_suites.py).

A suite is one script in a folder of bench/ by subject; its name is the script's file name
without its suffix (`python bench/run.py sim_pla_serve ...` runs bench/paper/sim_pla_serve.py).
Its one-line description is the first sentence of the script's docstring (of its first comment
block for a shell script), so that it is written once, where the script is.
"""

from __future__ import annotations

import ast
import difflib
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

# the checkout's root: bench/ lies beside medha/ (an editable install, or a run from a checkout)
ROOT = Path(__file__).resolve().parents[2]

# subject -> (what its suites have in common, its scripts in the order the README lists them)
SUBJECTS: dict[str, tuple[str, str]] = {
    "paper": (
        "the papers' figures and claims, reproduced in the simulator or by arithmetic",
        (
            "sim_convoy_effect.py sim_capacity.py sim_chunking.py sim_policies.py"
            " sim_parallelism.py sim_parallel_figures.py sim_3d_parallel.py sim_pla_serve.py"
            " sim_orca_sarathi.py sim_aligned_serve.py sim_deferred_prefill_paper.py"
            " analytic_vs_paper.py medha_paper_arithmetic.py"
        ),
    ),
    "sim": (
        "the simulator and the scheduler on their own: policies, preemption, its speed, identity",
        (
            "sim_lars.py sim_slo_risk.py sim_swap_vs_recompute.py sim_prefix_cache.py"
            " sim_spp_vs_cp.py sim_deferred_prefill.py sim_engine_schedule.py sim_identity.py"
            " sim_speed.py vidur_anchor.py scheduler_overhead.py scheduling_scenarios.py"
            " predictor_accuracy.py machine_kinds.py"
        ),
    ),
    "engine": (
        "medha's engine on this machine's CPU: correctness, throughput, what a step costs",
        (
            "engine_correctness.py engine_tokens.py engine_throughput.py"
            " engine_tree_throughput.py hf_baselines.py engine_bookkeeping.py engine_step_cost.py"
            " engine_convoy.py engine_spp.py engine_prefix_cache.py engine_predictor.py"
            " engine_fault_injection.py engine_vs_peers.py plan_vs_engine.py"
        ),
    ),
    "cli": (
        "the `medha` command: start-up, a newcomer's first answers",
        "cli_startup.py first_start.py",
    ),
    "server": (
        "one `medha serve` through its HTTP API: latency, mixed load, hostile requests, fuzzing",
        "server_latency.py server_mixed_load.py server_hostile.py server_fuzz.py",
    ),
    "route": (
        "`medha route` in front of replicas: SLOs, its overhead, faults, membership",
        "route_slo.py route_overhead.py route_faults.py route_membership.py",
    ),
    "vllm": (
        "medha's scheduler on vLLM's engine against vLLM's own (needs vllm)",
        (
            "vllm_correctness.py vllm_latency.py vllm_overhead.py vllm_async_timeline.py"
            " vllm_convoy.py vllm_goodput.py vllm_mixed_load.py"
        ),
    ),
    "gpu": (
        "the engine and its kernels on a CUDA GPU",
        (
            "gpu_session.sh engine_device.py engine_gpu_parts.py engine_cuda_check.py"
            " cuda_graph_prefill.py kv_swap_cuda.py aligned_attention_cuda.py"
        ),
    ),
}


@dataclass(frozen=True)
class Suite:
    name: str
    subject: str
    path: str  # from the checkout's root, as commands and docs name it

    @property
    def description(self) -> str:
        return describe(ROOT / self.path)

    @property
    def command(self) -> tuple[str, ...]:
        """What runs it from the checkout's root (with this Python for a Python script)."""
        return ("bash", self.path) if self.path.endswith(".sh") else ("python", self.path)


SUITES: dict[str, Suite] = {
    file.rsplit(".", 1)[0]: Suite(file.rsplit(".", 1)[0], subject, f"bench/{subject}/{file}")
    for subject, (_, files) in SUBJECTS.items()
    for file in files.split()
}


def script(name: str) -> str:
    """The suite's script, from the checkout's root (`bench/paper/sim_pla_serve.py`)."""
    return SUITES[name].path


def close_matches(name: str) -> list[str]:
    """Suites whose name contains `name`, then those near it by spelling; at most 6."""
    within = [s for s in SUITES if name in s]
    near = difflib.get_close_matches(name, SUITES, n=6, cutoff=0.5)
    return (within + [s for s in near if s not in within])[:6]


@cache
def describe(path: Path) -> str:
    """The first sentence of a script's docstring (of its first comment block after the shebang
    for a shell script); empty where it has none."""
    try:
        text = path.read_text()
    except OSError:
        return ""
    if path.suffix == ".py":
        doc = ast.get_docstring(ast.parse(text)) or ""
    else:
        block = []
        for line in text.splitlines()[1:]:
            if not line.startswith("#"):
                break
            block.append(line[1:].strip())
        doc = "\n".join(block)
    first = " ".join(doc.strip().split("\n\n")[0].split())
    # a sentence ends at a full stop before a capital ("Fig. 4" and "et al.," do not end one)
    return re.split(r"\.\s+(?=[A-Z`(])", first)[0].rstrip(".:,")
