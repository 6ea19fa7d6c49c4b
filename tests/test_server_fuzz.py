"""schemathesis against a real `medha serve` (bench/server/server_fuzz.py, bounded for CI): no
response >= 500, every documented status and body as the OpenAPI document says, schema-invalid
input refused, /health 200 throughout."""

import json
import subprocess
import sys
from pathlib import Path

FUZZ = Path(__file__).resolve().parents[1] / "bench" / "server" / "server_fuzz.py"


def fuzz(args: list[str], summary: Path) -> dict:
    """Run the benchmark as a script, as by hand (bench/ is no package to import from), and
    read its summary."""
    subprocess.run([sys.executable, str(FUZZ), *args, "--json", str(summary)], check=True)
    return json.loads(summary.read_text())


def test_schemathesis_finds_nothing_and_health_stays_200(tmp_path):
    summary = fuzz(
        ["--max-examples", "25", "--seeds", "7", "--dtype", "float32"], tmp_path / "s.json"
    )
    assert summary["cases"] >= 500  # coverage phase + fuzzing of 5 operations
    assert summary["failures"] == [] and summary["errors"] == []
    # polled throughout: at least a third of one poll per POLL_S of the run, however long it
    # took (an answer may take a while on a busy machine)
    polls = summary["health_polls"]
    assert polls >= max(3, summary["seconds"] / summary["poll_s"] / 3), summary
    assert summary["health_not_200"] == []
    assert summary["server_alive"] and summary["serves_after"] == 200
