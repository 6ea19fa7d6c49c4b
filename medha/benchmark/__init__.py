"""`medha bench`: an open-loop load generator for any OpenAI-compatible server.

Requests leave at their scheduled arrival times whatever the server is doing (open loop), each
one streams, and every text chunk is timestamped on arrival: TTFT, each TBT, TPOT and E2E are
the client's view, network and queueing included.
"""

# The docstring above is `medha bench --help`. Besides `medha bench` (config, workload,
# load_generator), this package holds what the scripts in bench/ share with each other and with
# tests/, so that both import it by name: harness (the flags every bench shares, percentiles, a
# Markdown table), suites (their registry, for bench/run.py and bench/tables.py), local_server,
# vllm_servers, hf_baselines, tiny_llama, faults, logits, scenarios, stub_backend, routers; and
# the named parts of the larger benches, so that a script keeps only its flags and its tables:
# route_workloads, route_client, route_calibration, route_probes, route_twin and route_report
# (bench/route/route_slo.py), pla_workload and pla_runs (bench/paper/sim_pla_serve.py),
# parallel_bench and parallel_decode (bench/paper/sim_parallel_figures.py), engine_rows
# (bench/gpu/engine_device.py) and gpu_parts (bench/gpu/engine_gpu_parts.py). Those two GPU
# scripts load their module (and harness) by its path and measure whichever medha is on the path
# (another checkout's with --against or --project), so engine_rows and gpu_parts import medha only
# inside their functions. What only the tests use is in medha/testing/ (tests/test_imports.py
# keeps it there). Importing the package imports none of them; faults, logits, hf_baselines and
# gpu_parts import torch (engine_rows inside its rows), so only the tests and benchmarks that run
# an engine load them.
