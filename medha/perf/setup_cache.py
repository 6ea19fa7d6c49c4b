"""Tables derived from the cost model, kept on disk so that a repeated `medha simulate` starts at
once.

Two parts of the set-up cost seconds each time: fitting the profiled predictor to its profile
(hundreds of least-squares fits) and walking one lone prefill over the model's whole context
for the prefill-time cache (a million tokens for Llama-3). Both are pure functions of their
inputs, so they are stored in cache_dir()/setup/ (MEDHA_CACHE_DIR moves it), one JSON file per
set of inputs, named by a hash of all of them: what the caller passes (the predictor's
fingerprint, the scheduler config, ...), FORMAT, and the source of medha.core, medha.perf and
medha.scheduler (the code that computes them), so that an edited cost formula never serves old
numbers. Floats round-trip exactly through JSON: a run from the cache is bit-identical to one
without it.

A file that cannot be read or parsed is a miss, never an error; files are written to a
temporary name and renamed, so that a reader sees a whole file or none. MEDHA_NO_SETUP_CACHE=1
turns the cache off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from medha.perf.hardware_specs import cache_dir

if TYPE_CHECKING:
    from medha.perf.predictor import Predictor
    from medha.perf.prefill_time_cache import PrefillTimeCache

log = logging.getLogger("medha.perf")

FORMAT = 1  # bump when what a file holds changes
_CODE = ("core", "perf", "scheduler")  # the packages whose code computes what is stored


@cache
def _code_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for package in _CODE:
        for path in sorted((root / package).rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def path_for(kind: str, inputs: dict) -> Path | None:
    """The file that holds (or will hold) what `inputs`, JSON data, give; None when the cache
    is off."""
    if os.environ.get("MEDHA_NO_SETUP_CACHE", "") not in ("", "0"):
        return None
    text = json.dumps(
        {"format": FORMAT, "code": _code_digest(), "kind": kind, "inputs": inputs}, sort_keys=True
    )
    return cache_dir() / "setup" / f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


def read(path: Path | None) -> dict | None:
    """The stored document, or None when there is none that can be read."""
    if path is None:
        return None
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):  # missing, unreadable, truncated or not JSON
        return None
    return data if isinstance(data, dict) else None


def write(path: Path | None, data: dict) -> None:
    """Store `data` whole or not at all; a cache that cannot be written only costs time."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(data, fh)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        log.warning("could not write the set-up cache %s: %s", path, e)


class StoredWalk:
    """A prefill-time cache's walk on disk: taken over when a run with the same inputs stored
    one, and stored again by `save` once this run has walked further."""

    def __init__(self, times: PrefillTimeCache, predictor: Predictor, config: object) -> None:
        """`config`: the scheduler's config (a dataclass) that plans the walk; typed loosely,
        since perf/ sits below the scheduler that defines it."""
        self.times = times
        fingerprint = predictor.fingerprint()
        self.path = (
            None
            if fingerprint is None
            else path_for(
                "prefill-times",
                {
                    "predictor": fingerprint,
                    "scheduler": dataclasses.asdict(config),
                    "max_len": times.max_len,
                },
            )
        )
        data = read(self.path)
        if data is not None:
            try:
                times.restore(data)
            except ValueError:
                pass  # not a walk: walk again, and replace it
        self._stored_len = times.boundaries[-1]

    def save(self) -> None:
        if self.times.boundaries[-1] > self._stored_len:
            write(self.path, self.times.walked())
            self._stored_len = self.times.boundaries[-1]
