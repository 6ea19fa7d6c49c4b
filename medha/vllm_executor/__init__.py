"""medha's scheduler on vLLM's engine: the third executor, beside the simulator and medha's own
engine.

vLLM's v1 engine core calls its scheduler twice a step: `schedule()` decides how many tokens of
which requests the next forward pass runs, and `update_from_output()` applies what it sampled.
`MedhaScheduler` (scheduler.py) is such a scheduler. Its decisions come from medha's
`ReplicaScheduler`, the object the simulator and medha's engine drive, fed with a mirror of each
vLLM request; vLLM's own scheduler code then carries them out, so vLLM's KV cache manager (and
its prefix caching), its output format and its bookkeeping stay vLLM's.

Two ways in:

    medha serve --engine vllm --model DIR [medha's scheduler flags]
    python -m vllm.entrypoints.openai.api_server --model DIR \\
        --scheduler-cls medha.vllm_executor.MedhaScheduler \\
        --additional-config '{"medha": {"policy": "lars", "chunking": "adaptive"}}'

Only this package imports vLLM; importing it without vLLM installed raises ImportError naming
the extra to install.
"""

from medha.vllm_executor.contract import SUPPORTED_VLLM, check_vllm_version

check_vllm_version()

from medha.vllm_executor.scheduler import MedhaAsyncScheduler, MedhaScheduler  # noqa: E402

__all__ = ["MedhaAsyncScheduler", "MedhaScheduler", "SUPPORTED_VLLM", "check_vllm_version"]
