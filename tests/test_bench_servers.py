"""The servers the vLLM benchmarks compare (medha/benchmark/vllm_servers.py) share one set of
flags: each contender's command carries every one of them."""

import argparse

from medha.benchmark.vllm_servers import (
    add_server_args,
    engine_command,
    server_command,
    server_flags,
)


def _flags(*argv):
    ap = argparse.ArgumentParser()
    add_server_args(ap)
    return server_flags(ap.parse_args(["--model", "/models/long", *argv]))


def _value(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_every_server_gets_the_context_asked_for():
    """--max-model-len reaches plain vLLM, vLLM with medha's scheduler (behind either front end)
    and medha's own engine: a longer context than SmolLM2's (a copy of it whose config.json
    allows one) runs on every contender, or the comparison would not be of one prompt."""
    flags = _flags("--max-model-len", "16384")
    commands = [
        server_command(flags, None)(8000),
        server_command(flags, {"policy": "lars"})(8000),
        server_command(flags, {"policy": "lars"}, front="medha")(8000),
        engine_command(flags, {})(8000),
    ]
    for cmd in commands:
        assert _value(cmd, "--max-model-len") == "16384"
        assert _value(cmd, "--model") == "/models/long"
    assert _value(server_command(_flags(), None)(8000), "--max-model-len") == "8192"
