"""The benchmark scripts start: each one's ``--help`` from outside the repository, and the states' generators import.

``make bench`` runs for an hour; an import that broke (a module moved, a path no longer on ``sys.path``) should
fail here in seconds rather than there after the first sections. Nothing is measured.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py")
                 if p.name.startswith(("bench_", "run_all", "cuda_check")) and "__main__" in p.read_text())


def test_there_are_scripts_to_check():
    assert {"run_all.py", "bench_engine.py", "bench_layouts.py", "bench_s3_save.py", "bench_scale.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_benchmark_script_starts_from_any_directory(script, tmp_path):
    r = subprocess.run([sys.executable, str(BENCH / script), "--help"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, f"{script} --help exited {r.returncode}:\n{r.stderr[-3000:]}"
    assert "usage" in r.stdout.lower()


def test_the_states_generators_import_from_any_directory(tmp_path):
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import states; "
            "from tests.megatron_synthetic import ModelSpec, SyntheticJob, spec_for_bytes; "
            "print(sorted(states.STATES))")
    r = subprocess.run([sys.executable, "-c", code, str(BENCH)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "megatron_2g" in r.stdout and "fp32_1g" in r.stdout
