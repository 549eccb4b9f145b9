"""The package in someone else's environment: an opt-in pytest plugin that costs nothing until used, a wheel
with LICENSE and py.typed, complete metadata, install hints that name our extras, lower bounds that are tested."""

from __future__ import annotations

import platform
import re
import subprocess
import sys
import textwrap
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pytest(tmp_path: Path, test: str, *args: str) -> subprocess.CompletedProcess:
    """A pytest run of one unrelated test file in a fresh directory, in this environment."""
    (tmp_path / "test_unrelated.py").write_text(textwrap.dedent(test))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args,
                           "test_unrelated.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_an_unrelated_pytest_run_neither_imports_us_nor_gains_our_fixtures(tmp_path):
    assert "pytest11" not in {ep.group for ep in metadata.distribution("tiered-ckpt").entry_points}
    proc = _pytest(tmp_path, """
        import sys

        def test_nothing_of_ours_is_loaded():
            loaded = [m for m in sys.modules if m == "torch" or m.split(".")[0] == "tiered_ckpt"]
            assert loaded == []

        def test_our_fixtures_are_not_there(request):
            for name in ("make_tier", "shm_root", "s3_server", "tier_context"):
                try:
                    request.getfixturevalue(name)
                except Exception as exc:
                    assert type(exc).__name__ == "FixtureLookupError", exc
                else:
                    raise AssertionError(name)
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout


def test_the_plugin_when_asked_for_gives_the_fixtures_and_imports_torch_only_when_they_need_it(tmp_path):
    proc = _pytest(tmp_path, """
        import sys

        def test_loading_the_plugin_imported_nothing_heavy():
            assert "torch" not in sys.modules and "tiered_ckpt.engine" not in sys.modules

        def test_fixtures(make_tier, tier_context):
            tier = make_tier("fsspec")
            tier.write_blob("a", [b"xyz"])
            assert tier.list("") == ["a"] and tier_context.run_id.startswith("test-")
    """, "-p", "tiered_ckpt.testing.pytest_plugin")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out.glob("tiered_ckpt-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_ships_license_and_py_typed_and_complete_metadata(wheel):
    names = wheel.namelist()
    assert "tiered_ckpt/py.typed" in names
    if platform.machine() in ("x86_64", "AMD64"):  # the streaming copy, compiled (optional where it cannot be)
        assert any(n.startswith("tiered_ckpt/_streamcopy") and n.endswith(".so") for n in names), names
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    assert f"{dist_info}/licenses/LICENSE" in names
    assert "Apache License" in wheel.read(f"{dist_info}/licenses/LICENSE").decode()
    meta = wheel.read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in meta and "License-File: LICENSE" in meta
    assert "Classifier: Typing :: Typed" in meta and "Classifier: Programming Language :: Python :: 3.11" in meta
    # (no Project-URL yet: the project's public home is not decided; a guessed address would mislead)
    entry_points = wheel.read(f"{dist_info}/entry_points.txt").decode()
    assert "pytest11" not in entry_points and "tiered-ckpt = tiered_ckpt.cli:main" in entry_points
    # Linters are for developers, not for the test extra users install to run our contract suite.
    extras = set(re.findall(r"^Requires-Dist: ([A-Za-z0-9_.\-]+).*extra == \"(\w+)\"", meta, re.M))
    assert ("ruff", "dev") in extras and ("pytest", "test") in extras and ("ruff", "test") not in extras


def test_license_metadata_uses_the_spdx_form_and_a_build_backend_that_knows_it():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "setuptools>=77" in PYPROJECT["build-system"]["requires"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert not any(r.startswith("ruff") for r in project["optional-dependencies"]["test"])


def test_a_missing_s3fs_names_our_extra():
    script = textwrap.dedent("""
        import sys
        sys.modules["s3fs"] = None  # as if it were not installed
        from tiered_ckpt.errors import ConfigError
        from tiered_ckpt.tiers.fsspec_tier import FsspecOptions, FsspecTier
        try:
            FsspecTier("remote", FsspecOptions(url="s3://bucket/run"))
        except ConfigError as exc:
            print(exc)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "pip install 'tiered-ckpt[s3]'" in proc.stdout, proc.stdout + proc.stderr


def _lower_bounds() -> dict[str, str]:
    specs = PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["test"]
    out = {}
    for spec in specs:
        m = re.match(r"([A-Za-z0-9_.\-\[\]]+)\s*>=\s*([0-9][^,;\s]*)", spec)
        if m:
            out[m.group(1).split("[")[0].lower()] = m.group(2)
    return out


def test_make_lowest_installs_exactly_the_declared_lower_bounds():
    proc = subprocess.run([sys.executable, str(ROOT / ".ci" / "lower_bounds.py")], capture_output=True, text=True,
                          timeout=60, check=True)
    pinned = {}
    for line in proc.stdout.split("\n"):
        if line.strip():
            name, version = line.split(";")[0].strip().split("==")
            pinned[name.split("[")[0].lower()] = version
    bounds = _lower_bounds()
    # torch is installed first, on its own, at its floor (--torch): pip must never resolve it; megatron-core is only
    # for tests/megatron_real, which the smoke subset does not run.
    assert pinned == {k: v for k, v in bounds.items() if k not in ("torch", "megatron-core")}
    torch_floor = subprocess.run([sys.executable, str(ROOT / ".ci" / "lower_bounds.py"), "--torch"],
                                 capture_output=True, text=True, timeout=60, check=True).stdout
    assert torch_floor == f"torch=={bounds['torch']}\n"
    makefile = (ROOT / "Makefile").read_text()
    lowest = makefile.split("\nlowest:")[1]
    assert "lower_bounds.py --torch" in makefile and "$(LOWEST_TORCH_SPEC)" in lowest and "$(TORCH_SPEC)" not in lowest
