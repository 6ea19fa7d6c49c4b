import json
import subprocess
import sys


def medha(*args, check=True):
    out = subprocess.run([sys.executable, "-m", "medha", *args], capture_output=True, text=True)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def test_help_lists_commands_and_config_help():
    assert "demo" in medha("--help").stdout
    text = medha("demo", "--help").stdout
    assert "--rho-max" in text and "space sharing" in text and "--multi-prefill" in text


def test_demo_runs_on_the_default_model():
    out = medha("demo", "--num-short", "10").stdout
    assert "smollm2-135m on cpu" in out
    for label in ("orca / vLLM", "sarathi", "edf + adaptive", "medha: lars + adaptive"):
        assert label in out


def test_chunks_shrink_for_a_long_prompt():
    out = medha("chunks", "--prompt-len", "300000").stdout
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    chunks = [int(r[1]) for r in rows[:-1]]  # the last line is the summary
    assert len(chunks) > 5 and chunks[0] > chunks[-2]
    assert "predicted prefill time" in out


def test_predict_prints_json():
    data = json.loads(medha("predict", "--tp", "8", "--prefill", "512@1000000",
                            "--decode", "32@4000").stdout)
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
