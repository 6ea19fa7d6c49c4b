"""`medha bench`: an open-loop load generator for any OpenAI-compatible server.

Requests leave at their scheduled arrival times whatever the server is doing (open loop), each
one streams, and every text chunk is timestamped on arrival: TTFT, each TBT, TPOT and E2E are
the client's view, network and queueing included.
"""

# The docstring above is `medha bench --help`. Besides `medha bench` (config, workload,
# load_generator), this package holds what the scripts in bench/ share with each other and with
# tests/, so that both import it by name: local_server, vllm_servers, hf_baselines, tiny_llama,
# faults, logits, scenarios, stub_backend, routers; harness (the flags and percentiles every
# suite shares) and suites (their registry, for bench/run.py). What only the tests use is in
# medha/testing/ (tests/test_imports.py keeps it there). Importing the package imports none of
# them; faults, logits and hf_baselines import torch, so only the tests and benchmarks that run
# an engine load them.
