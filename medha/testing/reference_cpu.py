"""The CPU the test suite plans for, on whatever machine it runs.

medha's engine plans with the roofline of the CPU it measures (`this_cpu`: a 1024^2 fp32 GEMM
on all cores and a memory copy, cached under $MEDHA_CACHE_DIR/hardware). Chunk sizes, step
budgets and so every schedule follow those two numbers, which differ between machines and
between two measurements on one machine (148 and 174 GFLOP/s on the same 2-core EPYC, minutes
apart). A test that compares schedules, or needs a prompt cut into several chunks, would pass
on one machine and fail on another. tests/conftest.py therefore stores REFERENCE_CPU as the
measured CPU of every test session before anything runs, so that the engines, servers and
routers the tests start, in process or not, plan the same steps everywhere. What the real
machine does with its own measurement is a benchmark's question (bench/), not a test's.
"""

from __future__ import annotations

from medha.perf.hardware_specs import cpu_spec, store_cpu_spec

# A 2-core AVX-512 EPYC's fp32 GEMM rate (measured 148-174 GFLOP/s), with a copy bandwidth of
# 40 GB/s. That machine's own 19.5 GB/s sits next to the switch of the chunking price
# (medha/perf/chunking_price.py), where a pipelined 900-token prompt goes from 8 chunks of
# ~130 tokens to 128 chunks of 2 with a few GB/s less (tests/test_parallel_schedule.py);
# at 40 GB/s the schedules stay clear of it.
REFERENCE_CPU = cpu_spec(peak_flops=150e9, mem_bw=40e9, mem_bytes=24 * 2.0**30)


def pin_reference_cpu() -> None:
    """Store REFERENCE_CPU as this machine's measured CPU in $MEDHA_CACHE_DIR."""
    store_cpu_spec(REFERENCE_CPU, "medha/testing/reference_cpu.py")
