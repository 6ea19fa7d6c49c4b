"""Accelerators the predictor knows, and this machine's CPU (measured once, then cached)."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HardwareSpec:
    """Peak rates of one device, and how much of them real kernels reach.

    The efficiency factors are the share of peak that large kernels of each kind sustain; they are
    what turns a roofline into a time estimate. GPU values follow published cuBLAS / FlashAttention
    / NCCL measurements and were checked against the bundled A100 profile
    (docs/predictor_accuracy.md).
    """

    name: str
    peak_flops: float  # dense FLOP/s at the serving dtype (bf16 on GPUs, fp32 on CPU)
    mem_bw: float  # bytes/s
    mem_bytes: float
    dtype_bytes: int
    link_bw: float  # collective bus bandwidth inside a node, bytes/s per device
    link_latency_s: float  # per ring step
    internode_bw: float  # bytes/s per device across nodes (KVP groups, SPP across nodes)
    internode_latency_s: float
    devices_per_node: int
    gemm_eff: float
    attn_eff: float  # flash attention with full query tiles
    attn_tile_rows: int  # query rows per KV head at which a tile is half used
    mem_eff: float  # long streaming reads: weights, KV cache
    elementwise_eff: float  # small unfused kernels: norms, rope, activations
    kernel_overhead_s: float  # per kernel launch
    iteration_overhead_s: float  # per iteration: input preparation, sampling, bookkeeping
    # device <-> host memory, bytes/s per device, one direction (what KV swapping moves over);
    # 0: a copy within host memory, half the measured read+write copy bandwidth. GPUs: PCIe
    # 4.0/5.0 x16 with pinned memory; an H100 here measured 49.7 GB/s host-to-device and 54.8
    # device-to-host (bench/gpu/kv_swap_cuda.py); the A100 figure is PCIe 4.0's usual, unmeasured
    host_bw: float = 0.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def host_link_bw(self) -> float:
        return self.host_bw or self.mem_bw / 2


_GPU_COMMON = dict(
    dtype_bytes=2,
    internode_bw=40e9,
    internode_latency_s=10e-6,
    devices_per_node=8,
    attn_tile_rows=32,
    mem_eff=0.8,
    elementwise_eff=0.45,
    kernel_overhead_s=4e-6,
    iteration_overhead_s=1e-3,
)
GPUS: dict[str, HardwareSpec] = {
    "a100": HardwareSpec(
        "a100",
        peak_flops=312e12,
        mem_bw=2.039e12,
        mem_bytes=80e9,
        link_bw=200e9,
        link_latency_s=4.5e-6,
        gemm_eff=0.75,
        attn_eff=0.6,
        host_bw=25e9,
        **_GPU_COMMON,
    ),
    "h100": HardwareSpec(
        "h100",
        peak_flops=989e12,
        mem_bw=3.35e12,
        mem_bytes=80e9,
        link_bw=400e9,
        link_latency_s=3e-6,
        gemm_eff=0.7,
        attn_eff=0.6,
        host_bw=50e9,
        **_GPU_COMMON,
    ),
    "h200": HardwareSpec(
        "h200",
        peak_flops=989e12,
        mem_bw=4.8e12,
        mem_bytes=141e9,
        link_bw=400e9,
        link_latency_s=3e-6,
        gemm_eff=0.7,
        attn_eff=0.6,
        host_bw=50e9,
        **_GPU_COMMON,
    ),
}
_ALIASES = {
    "a100-80gb": "a100",
    "a100_80gb": "a100",
    "h100-80gb": "h100",
    "h100_80gb": "h100",
    "h100-sxm": "h100",
    "h200-141gb": "h200",
}
HARDWARE_NAMES = sorted([*GPUS, "cpu"])


def get_hardware(name: str) -> HardwareSpec:
    key = _ALIASES.get(name.lower(), name.lower())
    if key == "cpu":
        return this_cpu()
    if key not in GPUS:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE_NAMES)}")
    return GPUS[key]


def cache_dir() -> Path:
    return Path(os.environ.get("MEDHA_CACHE_DIR", Path.home() / ".cache" / "medha"))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# the CPU flags (in /proc/cpuinfo) of native bf16 arithmetic, which oneDNN's bf16 kernels
# (torch's CPU linear layers) use; without them bf16 is emulated (not measured here)
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """This CPU's flags (or those of the CPU `cpuinfo` describes, /proc/cpuinfo's text); empty
    where they cannot be told (no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU (or the one `cpuinfo` describes, /proc/cpuinfo's text) computes in bf16
    natively: AVX512-BF16 or AMX. False where it cannot be told (no /proc/cpuinfo)."""
    return any(f in cpu_flags(cpuinfo) for f in BF16_CPU_FLAGS)


def cpu_serving_dtype(dtype: str) -> str:
    """`dtype` as medha serves it on this CPU, on either engine (medha's `resolve_dtype`, vLLM's
    `vllm_dtype_arg`): `auto` is float32 on a CPU without bf16 instructions, where vLLM's own auto
    would keep a bf16 checkpoint's bf16, emulated: on a 2-core Ice Lake Xeon SmolLM2's
    6,000-token prompt took 29.5 s in bf16 on vLLM and 16.9 s in float32, eight short chats
    2.06 s and 0.89 s (docs/vllm.md, "Another machine kind"). Elsewhere as given (`auto`: the
    engine's choice)."""
    if dtype == "auto" and not cpu_has_bf16():
        return "float32"
    return dtype


def cpu_has_avx512(cpuinfo: str | None = None) -> bool:
    """Whether this CPU (or the one `cpuinfo` describes) has AVX-512 (its foundation, avx512f).
    False where it cannot be told."""
    return "avx512f" in cpu_flags(cpuinfo)


def _measure_gemm_flops(n: int = 1024, seconds: float = 1.0) -> tuple[float, str]:
    """Best sustained fp32 GEMM rate with all cores: torch when installed (the engine's
    kernels), else numpy."""
    try:
        import torch
    except ImportError:
        import numpy as np

        a, b = np.random.rand(n, n).astype(np.float32), np.random.rand(n, n).astype(np.float32)
        return _best_rate(lambda: a @ b, n, seconds), f"numpy {np.__version__}"
    # all cores for the measurement, then the process's own count back: a measurement taken
    # on first use must not override --threads, OMP_NUM_THREADS or a worker's share of cores
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        return _best_rate(lambda: torch.mm(a, b), n, seconds), f"torch {torch.__version__}"
    finally:
        torch.set_num_threads(threads)


def _best_rate(mm, n: int, seconds: float) -> float:
    mm()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        mm()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def _measure_copy_bw(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    import numpy as np

    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * nbytes / best  # read + write


def measure_cpu() -> tuple[HardwareSpec, str]:
    flops, lib = _measure_gemm_flops()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return cpu_spec(flops, _measure_copy_bw(), float(mem)), lib


def cpu_spec(peak_flops: float, mem_bw: float, mem_bytes: float) -> HardwareSpec:
    """A CPU as the roofline sees it, from the three numbers measure_cpu takes."""
    return HardwareSpec(
        name="cpu",
        peak_flops=peak_flops,
        mem_bw=mem_bw,
        mem_bytes=mem_bytes,
        dtype_bytes=4,
        # gloo over shared memory between worker processes
        link_bw=5e9,
        link_latency_s=30e-6,
        internode_bw=1e9,
        internode_latency_s=100e-6,
        devices_per_node=1,
        # peak and bandwidth are measured with the same kind of kernel, hence 1.0
        gemm_eff=1.0,
        attn_eff=0.5,
        attn_tile_rows=8,
        mem_eff=1.0,
        elementwise_eff=0.5,
        kernel_overhead_s=10e-6,
        iteration_overhead_s=2e-3,
    )


_cpu_spec: HardwareSpec | None = None


def this_cpu(refresh: bool = False) -> HardwareSpec:
    """This machine's CPU, measured on first use and cached under ~/.cache/medha/hardware."""
    global _cpu_spec
    if _cpu_spec is not None and not refresh:
        return _cpu_spec
    path = _cpu_cache_path()
    if not refresh and path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == _cpu_key():
                _cpu_spec = HardwareSpec(**data["spec"])
                return _cpu_spec
        except (ValueError, TypeError, KeyError):
            pass  # unreadable cache: measure again
    spec, lib = measure_cpu()
    store_cpu_spec(spec, lib)
    _cpu_spec = spec
    return spec


def _cpu_key() -> str:
    return f"{_cpu_model()}|{os.cpu_count()}"


def _cpu_cache_path() -> Path:
    return cache_dir() / "hardware" / "cpu.json"


def store_cpu_spec(spec: HardwareSpec, measured_with: str) -> None:
    """Cache `spec` as this machine's CPU: what every later process plans with (the test
    suite stores a fixed one, so that its schedules are the same on every machine)."""
    path = _cpu_cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    data = {"key": _cpu_key(), "measured_with": measured_with, "spec": spec.to_json()}
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
