"""scripts/gpu_check.sh parses, and the Python part it runs on a GPU runs here on the CPU (tiny sizes,
kernels forced: no tuning), with every lossless check passing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_shell_script_parses_and_refuses_a_machine_without_an_nvidia_gpu(tmp_path):
    subprocess.run(["bash", "-n", str(ROOT / "scripts/gpu_check.sh")], check=True)
    env = {**os.environ, "PATH": str(tmp_path)}  # no nvidia-smi on this PATH
    r = subprocess.run(["/bin/bash", str(ROOT / "scripts/gpu_check.sh")], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "no nvidia-smi" in r.stderr


def test_the_checks_run_on_the_cpu_and_write_one_table(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RACER_KERNELS": "linear:8",  # the cache as the suite's (a fresh one builds the library again)
    }
    out = tmp_path / "rows.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts/gpu_check.py"), "--device", "cpu", "--smoke", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "| every mode and budget equals off, float16 | 12/12 | yes |" in r.stdout
    assert "| every mode and budget equals off, bfloat16 | 12/12 | yes |" in r.stdout
    assert r.stdout.count("| cost curve ms,") == 2
    assert out.exists()
