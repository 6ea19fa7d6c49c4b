"""A checkpoint whose config.json is absurd, or disagrees with its weights, or whose weights are
corrupt, fails before the model is allocated: one line naming the file and the field."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from medha.engine.checkpoint import check_checkpoint, resolve_model
from medha.engine.errors import EngineError
from medha.engine.llm import LLM
from medha.engine.sampling_params import SamplingParams

DROP = object()  # a config change that deletes the field


def variant(src: str, dst: Path, **changes) -> Path:
    """The checkpoint `src` with its config.json changed; the other files are linked."""
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((Path(src) / "config.json").read_text())
    for key, value in changes.items():
        if value is DROP:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def refused(path: Path) -> str:
    with pytest.raises(EngineError) as e:
        check_checkpoint(path)
    message = str(e.value)
    assert "\n" not in message
    return message


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# the tiny model: vocab 49152, hidden 64, intermediate 160, 2 layers, 4 heads, 2 KV heads,
# head_dim 16, tied embeddings
ABSURD = [
    ({"vocab_size": 10**12}, "vocab_size must be a positive integer below 2**31, got 10"),
    ({"vocab_size": 1e12}, "vocab_size must be a positive integer below 2**31, got 1000"),
    ({"vocab_size": -5}, "vocab_size must be a positive integer below 2**31, got -5"),
    ({"vocab_size": "abc"}, "vocab_size must be a positive integer below 2**31, got 'abc'"),
    ({"vocab_size": True}, "vocab_size must be a positive integer below 2**31, got True"),
    ({"vocab_size": DROP}, "lacks 'vocab_size'"),
    ({"hidden_size": 2**40}, "hidden_size must be a positive integer"),
    ({"intermediate_size": 160.0}, "intermediate_size must be a positive integer"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    ({"num_attention_heads": None}, "num_attention_heads must be a positive integer"),
    ({"head_dim": 2**31}, "head_dim must be a positive integer"),
    ({"max_position_embeddings": 2**63}, "max_position_embeddings must be a positive integer"),
    (
        {"num_key_value_heads": 3},
        "num_attention_heads 4 is not a multiple of num_key_value_heads 3",
    ),
    (
        {"head_dim": DROP, "num_attention_heads": 6, "num_key_value_heads": 2},
        "hidden_size 64 is not a multiple of num_attention_heads 6",
    ),
    ({"head_dim": 15}, "head_dim must be even"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a positive finite number, got nan"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a positive finite number"),
    ({"rms_norm_eps": 10**400}, "rms_norm_eps must be a positive finite number"),
    ({"rope_parameters": {"rope_theta": float("inf")}}, "rope_theta must be a positive finite"),
    ({"rope_parameters": None, "rope_theta": "1e4"}, "rope_theta must be a positive finite"),
    ({"rope_parameters": [1]}, "rope_parameters must be an object"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling type"),
    ({"rope_scaling": {**LLAMA3, "factor": 0}}, "rope_scaling.factor must be a positive"),
    ({"rope_scaling": {**LLAMA3, "low_freq_factor": 4.0}}, "low_freq_factor 4.0 must be below"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ({"hidden_act": "gelu"}, "unsupported activation 'gelu'"),
    # sane numbers that disagree with the shapes in model.safetensors
    (
        {"vocab_size": 2**30},
        "vocab_size is 1073741824, but model.embed_tokens.weight in "
        "model.safetensors has shape [49152, 64]",
    ),
    ({"hidden_size": 128}, "hidden_size is 128, but model.embed_tokens.weight"),
    (
        {"intermediate_size": 2**20},
        "intermediate_size is 1048576, but model.layers.0.mlp.gate_proj.weight",
    ),
    (
        {"num_key_value_heads": 4},
        "num_key_value_heads * head_dim is 64, but model.layers.0.self_attn.k_proj.weight",
    ),
    (
        {"head_dim": 32},
        "num_attention_heads * head_dim is 128, but model.layers.0.self_attn.q_proj.weight",
    ),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers is 1000000000, but the weights hold 2"),
    ({"num_hidden_layers": 1}, "num_hidden_layers is 1, but the weights hold 2 layers"),
    (
        {"tie_word_embeddings": False},
        "tie_word_embeddings is false, but no weight file holds lm_head.weight",
    ),
    (
        {"attention_bias": True},
        "attention_bias is true, but no weight file holds layers.0.self_attn.q_proj.bias",
    ),
]


@pytest.mark.parametrize(
    "changes, error", ABSURD, ids=[f"{i}-{'+'.join(c)}" for i, (c, _) in enumerate(ABSURD)]
)
def test_absurd_configs_are_refused_with_the_field_named(tiny_model, tmp_path, changes, error):
    path = variant(tiny_model, tmp_path / "m", **changes)
    message = refused(path)
    assert message.startswith(f"{path / 'config.json'}: ") and error in message, message


def header(model: str) -> tuple[dict, bytes]:
    """The header of a model.safetensors, and the data after it."""
    raw = (Path(model) / "model.safetensors").read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_weights(path: Path, head: bytes | dict, data: bytes = b"", length=None) -> None:
    head = head if isinstance(head, bytes) else json.dumps(head).encode()
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").write_bytes(
        struct.pack("<Q", len(head) if length is None else length) + head + data
    )


def test_corrupt_weights_are_refused_with_the_file_named(tiny_model, tmp_path):
    head, data = header(tiny_model)
    path = variant(tiny_model, tmp_path / "m")
    weights = path / "model.safetensors"
    cases = [  # the safetensors library's own checks, each message behind the file's name
        ((head, data[: len(data) // 2]), "incomplete metadata, file not fully covered"),
        ((b"", b"", 2**62), "header too large"),
        ((b"{not json", data), "invalid JSON in header"),
        ((b"[]", data), "invalid JSON in header"),
        (
            ({**head, "model.norm.weight": {**head["model.norm.weight"], "dtype": "F3"}}, data),
            "unknown variant `F3`",
        ),
        (
            ({**head, "model.norm.weight": {**head["model.norm.weight"], "shape": [64, 2]}}, data),
            "invalid shape, data type, or offset",
        ),
    ]
    for args, error in cases:
        write_weights(path, *args)
        message = refused(path)
        assert message.startswith(f"{weights}: unreadable safetensors (") and error in message, (
            message
        )
    weights.write_bytes(b"abc")
    assert refused(path).startswith(f"{weights}: unreadable safetensors (")


def test_sharded_weights_are_checked_across_shards(tiny_model, tmp_path):
    head, data = header(tiny_model)
    path = variant(tiny_model, tmp_path / "m")
    (path / "model.safetensors").unlink()

    tensors = load_file(str(Path(tiny_model) / "model.safetensors"))

    def write(shards: dict[str, dict]) -> None:
        for file, names in shards.items():
            save_file({n: tensors[n] for n in names}, str(path / file))
        index = {"weight_map": {n: f for f, names in shards.items() for n in names}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))

    layer1 = {n: e for n, e in head.items() if "layers.1." in n}
    rest = {n: e for n, e in head.items() if n not in layer1 and n != "__metadata__"}
    write({"a.safetensors": rest, "b.safetensors": layer1})
    assert check_checkpoint(path)["vocab_size"] == 49152
    del layer1["model.layers.1.mlp.up_proj.weight"]
    write({"a.safetensors": rest, "b.safetensors": layer1})
    assert refused(path) == f"{path}: no weight file holds layers.1.mlp.up_proj.weight"
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [1]}))
    assert "unreadable shard index" in refused(path)


def test_sane_checkpoints_still_load(tiny_model):
    assert check_checkpoint(resolve_model("smollm2"))["num_hidden_layers"] == 30
    llm = LLM(tiny_model, kv_memory_gb=0.01)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 2


# A fork starts with its parent's memory, and Linux keeps that peak across exec: a small
# python starts the command, and reports its exit code and peak RSS (KiB) on stdout.
LAUNCH = (
    "import resource, subprocess, sys; "
    "code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode; "
    "print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def generate(model: Path) -> tuple[int, list[str], int]:
    """Exit code, stderr lines and peak RSS in bytes of `medha generate` on `model`."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            LAUNCH,
            sys.executable,
            "-m",
            "medha",
            "generate",
            "--model",
            str(model),
            "--prompt",
            "hi",
            "--max-tokens",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    code, peak = map(int, out.stdout.split())
    return code, out.stderr.splitlines(), peak * 1024


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"vocab_size": 10**12}, "vocab_size"),
        ({"vocab_size": 1e12}, "vocab_size"),
        ({"intermediate_size": 2**24}, "intermediate_size"),
    ],
)
def test_cli_exits_2_before_allocating(tiny_model, tmp_path, changes, field):
    path = variant(tiny_model, tmp_path / "m", **changes)
    code, lines, peak = generate(path)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"medha generate: error: {path / 'config.json'}: {field} ")
    # python, torch and transformers take about 300 MB; the configs ask for 256 TB and 4 GB
    assert peak < 1 << 30, peak


def test_cli_exits_2_on_truncated_weights(tiny_model, tmp_path):
    path = variant(tiny_model, tmp_path / "m")
    raw = (Path(tiny_model) / "model.safetensors").read_bytes()
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    code, lines, _ = generate(path)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"medha generate: error: {path / 'model.safetensors'}: ")


def test_the_embedded_model_converts_to_what_transformers_loads(tmp_path, monkeypatch):
    """The first start converts the GGUF with transformers parsing the file once, not three
    times (`_one_reader_per_file`: the newcomer's first answer waits for it), and writes the
    weights transformers itself computes with from that file, tensor for tensor; gguf's names
    are restored after it."""
    import gguf
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from medha.engine import checkpoint

    parsed = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            parsed.append(path)
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    names = gguf.GGUFReader, gguf.get_tensor_name_map
    src, out = checkpoint._gguf_path(), tmp_path / "converted"
    out.mkdir()
    checkpoint._convert(src, out)
    assert len(parsed) == 1
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == names
    ref = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    want = {k: v.numpy() for k, v in ref.state_dict().items()}
    got = load_file(str(out / "model.safetensors"))
    assert set(want) - set(got) == {"lm_head.weight"}  # tied to the embedding
    assert all(np.array_equal(v, want[k]) for k, v in got.items())
    assert len(parsed) == 3  # the reference model alone, unpatched: twice (config, weights)
