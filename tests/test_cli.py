import json
import math
import os
import shutil
import subprocess
import sys

import pytest


def medha(*args, check=True):
    # argparse wraps its help at $COLUMNS: wide enough that no phrase is split
    env = os.environ | {"COLUMNS": "200"}
    out = subprocess.run(
        [sys.executable, "-m", "medha", *args], capture_output=True, text=True, env=env
    )
    if check:
        assert out.returncode == 0, out.stderr
    return out


def test_help_lists_commands_and_config_help():
    assert "demo" in medha("--help").stdout
    text = medha("demo", "--help").stdout
    assert "--rho-max" in text and "space sharing" in text and "--multi-prefill" in text


def test_scheduler_flags_are_grouped_by_policy_and_concern():
    from medha.core.config import SCHEDULER_GROUPS
    from medha.scheduler.config import SchedulerConfig
    from medha.utils.dataclass_cli import flags

    for f in flags(SchedulerConfig):
        assert f.field.metadata.get("group") in SCHEDULER_GROUPS, f.name
    text = medha("serve", "--help").stdout
    titles = [line[:-1] for line in text.splitlines() if line[:-1] in SCHEDULER_GROUPS]
    assert titles == list(SCHEDULER_GROUPS)  # each once, in this order
    section = text.split("\ndeferred policy:\n")[1].split("\naligned policy:\n")[0]
    assert "--departure-threshold" in section and "--batch-cap" in section
    assert "--pla-w-max-s" in text.split("\npla policy:\n")[1]
    # the pla dispatcher's settings are the simulator's cluster's, not a replica's
    assert "--pla-window-s" not in text
    sim = medha("simulate", "--help").stdout
    assert "--pla-window-s" in sim.split("\npla dispatcher:\n")[1]


def demo_rows(out: str) -> dict[str, list[float]]:
    """`medha demo`'s table: configuration -> short TTFT p50, p99, met (a fraction), short TBT
    p99, long TTFT, long deadline."""
    from medha.demo import CONFIGS

    rows = {}
    for line in out.splitlines():
        label = next((c[0] for c in CONFIGS if line.startswith(c[0])), None)
        if label is not None:
            cells = line[len(label) :].replace("/", " ").split()
            rows[label] = [
                float(c[:-1]) / 100 if c.endswith("%") else float(c.rstrip("s")) for c in cells
            ]
    return rows


def test_demo_runs_on_the_default_model():
    """The demo's claim, on the test run's reference CPU (tests/conftest.py; the numbers are
    the same on every machine): among short requests next to a long prompt, medha's scheduler
    keeps the short requests' TTFT p99 below the plain FCFS one's."""
    out = medha("demo", "--num-short", "10").stdout
    assert "smollm2-135m on cpu" in out
    rows = demo_rows(out)
    orca, medha_row = rows["orca / vLLM (no chunking)"], rows["medha: lars + adaptive"]
    assert len(rows) == 4 and all(len(r) == 6 for r in rows.values()), out
    assert all(math.isfinite(x) for r in rows.values() for x in r), out
    assert len({tuple(r) for r in rows.values()}) > 1, out  # the configurations differ
    assert all(r[0] <= r[1] for r in rows.values()), out  # p50 <= p99
    assert medha_row[1] < orca[1], out  # short TTFT p99


def test_chunks_shrink_for_a_long_prompt():
    out = medha("chunks", "--prompt-len", "300000").stdout
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    chunks = [int(r[1]) for r in rows[:-1]]  # the last line is the summary
    assert len(chunks) > 5 and chunks[0] > chunks[-2]
    assert "predicted prefill time" in out


def test_predict_prints_json():
    data = json.loads(
        medha("predict", "--tp", "8", "--prefill", "512@1000000", "--decode", "32@4000").stdout
    )
    assert data["batch_time_ms"] > data["linear_ms"] > 0


def test_user_errors_exit_2_with_a_clear_message():
    out = medha("chunks", "--model", "gpt-9", check=False)
    assert out.returncode == 2 and "unknown model 'gpt-9'" in out.stderr
    assert "Traceback" not in out.stderr
    out = medha("demo", "--tpot-target-s", "-1", check=False)
    assert out.returncode == 2 and "tpot_target_s" in out.stderr
    out = medha("predict", "--prefill", "lots", check=False)
    assert out.returncode == 2 and "--prefill 'lots'" in out.stderr
    out = medha("chunks", "--hardware", "tpu", check=False)
    assert out.returncode == 2 and "unknown hardware 'tpu'" in out.stderr
    out = medha("chunks", "--tp", "zero", check=False)  # argparse's own type check
    assert out.returncode == 2


def simulate(out, *flags) -> tuple[int, list[str]]:
    """`medha simulate` of five requests in this process: exit code and stderr lines."""
    import contextlib
    import io

    from medha.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(
            [
                "simulate",
                "--hardware",
                "h100",
                "--qps",
                "2",
                "--num-requests",
                "5",
                "--quiet",
                "--no-plots",
                "--out",
                str(out),
                *flags,
            ]
        )
    return code, err.getvalue().splitlines()


def test_simulate_out_that_cannot_be_created_exits_2(tmp_path):
    import os

    a_file = tmp_path / "a_file"
    a_file.write_text("keep")
    cases = [
        (a_file / "run", f"{a_file} is not a directory"),
        (a_file / "deeper" / "run", f"{a_file} is not a directory"),
        ("/proc/medha-test-run", "cannot create a directory in /proc"),
    ]
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "locked").mkdir(mode=0o500)
        cases.append((tmp_path / "locked" / "run", "(Permission denied)"))
    for out, reason in cases:
        code, lines = simulate(out)
        assert code == 2 and len(lines) == 1, lines
        assert lines[0].startswith(f"medha simulate: error: --out {out}: ") and reason in lines[0]
    # a run that fails after its partial directory was made (the parent can take one) leaves
    # none behind
    fine = tmp_path / "fine"
    code, lines = simulate(fine / "run", "--max-model-len", "64")
    assert code == 2 and "exceed the model context of 64" in lines[0], lines
    assert fine.is_dir() and list(fine.iterdir()) == []


def test_simulate_overwrite_replaces_directories_and_links_never_files(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("keep")
    code, lines = simulate(a_file, "--overwrite")
    assert code == 2 and lines == [
        f"medha simulate: error: --out {a_file} is a file, not a "
        "directory; --overwrite replaces only a directory"
    ]
    assert a_file.read_text() == "keep"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data").write_text("keep")
    for target in (elsewhere, a_file, tmp_path / "missing"):
        link = tmp_path / "link"
        link.symlink_to(target)
        code, lines = simulate(link)
        assert code == 2 and "is a symlink; pass --overwrite" in lines[0], lines
        assert simulate(link, "--overwrite")[0] == 0  # the link, not its target, is replaced
        assert not link.is_symlink() and (link / "summary.json").is_file()
        shutil.rmtree(link)
    assert (elsewhere / "data").read_text() == "keep" and a_file.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "elsewhere"]


def test_output_dir_checks_out_again_before_replacing_it(tmp_path):
    from medha.sim.runner import OutputDirError, output_dir

    out = tmp_path / "out"
    with pytest.raises(OutputDirError, match="is a file"):
        with output_dir(out, overwrite=True) as tmp:
            (tmp / "summary.json").write_text("{}")
            out.write_text("appeared during the run")
    assert out.read_text() == "appeared during the run" and list(tmp_path.iterdir()) == [out]
