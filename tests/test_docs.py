"""Every Python example in README.md and docs/ runs, and every YAML configuration in them validates."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tiered_ckpt.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def blocks(path: Path, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(path.read_text()) if kind == lang]


def _needs_s3(text: str) -> bool:
    return "TIERED_CKPT_DOCS_S3" in text


@pytest.mark.parametrize("doc", [d for d in DOCS if blocks(d, "python")], ids=lambda p: p.name)
def test_python_examples_run(doc, tmp_path, request):
    code = "\n\n".join(blocks(doc, "python"))
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    if _needs_s3(code):
        server = request.getfixturevalue("s3_server")
        env.update(server.env() if hasattr(server, "env") else {})
    script = tmp_path / f"{doc.stem}_examples.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{doc.name} examples failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("doc", [d for d in DOCS if blocks(d, "yaml")], ids=lambda p: p.name)
def test_yaml_configurations_validate(doc, tmp_path):
    checked = 0
    for body in blocks(doc, "yaml"):
        data = yaml.safe_load(body)
        if isinstance(data, dict) and "tiers" in data:
            load_config(data, env={"TMPDIR": str(tmp_path), "S3_ENDPOINT": "http://127.0.0.1:9"})
            checked += 1
    assert checked or doc.name not in ("configuration.md",)
