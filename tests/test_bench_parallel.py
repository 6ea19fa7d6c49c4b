"""bench/paper/sim_parallel_figures.py --quick (the paper's parallelism figures at small sizes),
run as a script, as by hand (bench/ is no package to import from)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

FIGURES = Path(__file__).resolve().parents[1] / "bench" / "paper" / "sim_parallel_figures.py"


@pytest.fixture(scope="module")
def tables() -> dict[str, str]:
    """Each figure's printed table, by figure name."""
    out = {}
    for figure in ("3b", "17a", "18", "19", "20", "sarathi-pp"):
        res = subprocess.run(
            [sys.executable, str(FIGURES), "--quick", "--figure", figure],
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0, res.stderr
        out[figure] = res.stdout
    return out


def cells(table: str, first: str) -> list[str]:
    """The cells of the table row whose first cells start with `first`."""
    for line in table.splitlines():
        if line.startswith(f"| {first}"):
            return [c.strip() for c in line.strip("|").split("|")]
    raise AssertionError(f"no row {first!r} in\n{table}")


def test_every_figure_names_its_predictor(tables):
    for figure, text in tables.items():
        assert re.search(r"predictor: profiled on (h100|a100).*; llama-3-", text), figure


def test_small_chunks_cost_attention_little(tables):
    overhead = float(cells(tables["3b"], "32 |")[2].rstrip("%"))
    assert 0 < overhead < 30  # GQA: 32-token chunks already fill the tiles


def test_spp_scales_and_decodes_barely_notice(tables):
    row = cells(tables["17a"], "128K | 16 |")
    assert row[2] == "128" and float(row[4].rstrip("x")) > 8  # 128 GPUs
    spp8 = cells(tables["18"], "llama-3-8b | 4K")[-1]
    assert 0 <= float(re.search(r"\(([+-]\d+)%\)", spp8).group(1)) < 16


def test_kvp_cuts_multi_million_decodes(tables):
    assert cells(tables["19"], "llama-3-8b, SPP4 | 2M")[-1].startswith("-")


def test_fig20_reports_ttft_and_tbt(tables):
    row = cells(tables["20"], "64K | 1 |")
    assert len(row) == 4 and all(" s, " in c and c.endswith(" ms") for c in row[2:])


def test_microbatched_pp2_runs_a_lone_prefill_at_pp1_speed(tables):
    text = tables["sarathi-pp"]
    for chunking in ("static:512", "static:2048"):
        micro = float(cells(text, f"{chunking} | PP2 microbatch")[3].rstrip("x"))
        pp1 = float(cells(text, f"{chunking} | PP1")[3].rstrip("x"))
        assert 1.8 < micro and abs(micro - pp1) < 0.1


def run_figure(figure: str, *flags: str) -> str:
    res = subprocess.run(
        [sys.executable, str(FIGURES), "--quick", "--figure", figure, *flags],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_one_change_runs_move_only_what_they_change(tables):
    # the peak bandwidth instead of 0.8 of it: a decode's MBU rises by up to 1 / 0.8
    def mbu(text):
        return int(cells(text, "llama-3-8b | 1M")[2].split(", ")[1].rstrip("%"))

    base, peak = run_figure("16"), run_figure("16", "--hardware-set", "mem_eff=1.0")
    assert "(mem_eff=1)" in peak
    assert mbu(base) < mbu(peak) <= round(mbu(base) / 0.8) + 1
    # a costlier KVP merge slows the KVP2 decode and leaves KVP1's alone
    merged = run_figure("19", "--kvp-merge-us", "100")
    one, two = cells(tables["19"], "llama-3-8b, SPP4 | 2M"), cells(merged, "llama-3-8b, SPP4 | 2M")
    assert one[2] == two[2] and float(two[3].split()[0]) > float(one[3].split()[0])
    bad = subprocess.run(
        [sys.executable, str(FIGURES), "--figure", "16", "--hardware-set", "mem_eff"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "FIELD=NUMBER" in bad.stderr
