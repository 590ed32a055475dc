"""``stalwart local``'s output as a user reads it (issue 35): errors on stderr with nothing on stdout, ``status``
as text, JSON or YAML of the same facts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stalwart.local.cluster import LocalCluster


def local(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stalwart", "local", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def test_errors_go_to_stderr_and_stdout_stays_empty(tmp_path: Path) -> None:
    gone = local("status", "--dir", str(tmp_path / "none"))
    assert gone.returncode == 1 and gone.stdout == "" and gone.stderr.startswith("not running: ")
    bad = local("up", "--dir", str(tmp_path / "none"), "--nodes", "0")
    assert (bad.returncode, bad.stdout, bad.stderr.strip()) == (2, "", "--nodes: expected at least 1")
    wrong = local("kubeconfig", "--dir", str(tmp_path / "none"), "--service-account", "nonamespace")
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert wrong.stderr.strip() == "--service-account: expected NAMESPACE/NAME, got 'nonamespace'"


@pytest.mark.integration
def test_status_in_three_formats_says_the_same(local_cluster: LocalCluster) -> None:
    as_json = local("status", "--dir", str(local_cluster.dir), "-o", "json")
    as_yaml = local("status", "--dir", str(local_cluster.dir), "-o", "yaml")
    text = local("status", "--dir", str(local_cluster.dir))
    assert (as_json.returncode, as_yaml.returncode, text.returncode) == (0, 0, 0)
    info = json.loads(as_json.stdout)
    assert yaml.safe_load(as_yaml.stdout) == info
    assert info["api_url"] == local_cluster.api_url and info["ready"] is True
    lines = text.stdout.splitlines()
    assert lines[0] == f"local cluster in {local_cluster.dir}: ready"
    assert f"  api_url: {local_cluster.api_url}" in lines
    assert not text.stdout.lstrip().startswith("{")
