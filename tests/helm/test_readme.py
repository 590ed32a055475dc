"""The README's commands work as written: those that can run here are run (the two set-up commands aside, which
CI itself is), and the cluster steps are checked against what they would act on (the chart rendered with the
README's own `helm install` flags, the manifest its `sed` produces, the columns `kubectl get tj` shows)."""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from helm_render import Render, one

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
REGISTRY = "registry.example.com/you"


def shell_blocks() -> list[str]:
    """The README's ```sh blocks, continuation lines joined, comments dropped, $REGISTRY substituted."""
    commands: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", README, flags=re.S):
        joined = block.replace("\\\n", " ")
        for raw in joined.splitlines():
            line = raw.split("  #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(line.replace("$REGISTRY", REGISTRY))
    return commands


def command(prefix: str) -> str:
    found = [c for c in shell_blocks() if c.startswith(prefix)]
    assert len(found) == 1, f"the README should have one command starting {prefix!r}, found {found}"
    return found[0]


def stalwart(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stalwart", *args], capture_output=True, text=True, timeout=120,
                          input=stdin, cwd=REPO, check=False)


def set_flags(cmd: str) -> dict[str, Any]:
    """Helm's --set a.b=c flags as values (plain strings and booleans: all the README uses)."""
    values: dict[str, Any] = {}
    args = shlex.split(cmd)
    for flag, arg in itertools.pairwise(args):
        if flag != "--set":
            continue
        path, _, raw = arg.partition("=")
        value: Any = {"true": True, "false": False}.get(raw, raw)
        node = values
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return values


def test_the_version_command_works() -> None:
    done = stalwart("--version")
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"stalwart \S+\n", done.stdout), done.stdout


def test_every_example_is_in_the_readme_and_valid() -> None:
    named = set(re.findall(r"\(examples/([\w-]+\.yaml)\)", README))
    present = {p.name for p in (REPO / "examples").glob("*.yaml")}
    assert named == present, f"in examples/ but not in the README's table: {present - named}; " \
                             f"named but missing: {named - present}"
    done = stalwart("validate", *[arg for name in sorted(present) for arg in ("-f", f"examples/{name}")])
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert f"{len(present)} TrainingJobs valid" in done.stderr


def test_the_crd_command_prints_the_installed_crd() -> None:
    done = stalwart("crd")
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(done.stdout) == yaml.safe_load((REPO / "crds" / "trainingjob.yaml").read_text())


def test_the_helm_install_as_written_runs_the_pushed_image_and_the_bundled_etcd(render: Render) -> None:
    cmd = command("helm install stalwart helm/stalwart")
    docs = render(set_flags(cmd))
    [container] = one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"]
    pushed = command("docker push").split("&&")[0].split()[-1]
    assert container["image"] == pushed, (container["image"], pushed)
    assert one(docs, "StatefulSet", "-etcd")["spec"]["replicas"] >= 1


def test_the_applied_manifest_runs_the_pushed_trainer_image() -> None:
    cmd = command("sed ")
    sed_expr = shlex.split(cmd)[1]
    _, old, new, _ = sed_expr.split("|")
    manifest = (REPO / "examples" / "minimal.yaml").read_text()
    assert old in manifest
    applied = manifest.replace(old, new)
    assert f"{REGISTRY}/stalwart-trainer:0.1.0" in applied
    assert f"{REGISTRY}/stalwart-trainer:0.1.0" in command("docker push")
    done = stalwart("validate", "-f", "-", stdin=applied)
    assert done.returncode == 0, (done.stdout, done.stderr)


def test_the_columns_the_readme_shows_are_the_crds() -> None:
    [line] = [ln for ln in README.splitlines() if ln.startswith("kubectl get tj ") and "#" in ln]
    shown = line.split("#", 1)[1].split()
    crd = yaml.safe_load((REPO / "crds" / "trainingjob.yaml").read_text())
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    assert shown == [c["name"].upper() for c in columns if c.get("priority", 0) == 0]


def test_every_file_the_readme_commands_name_exists() -> None:
    named = {path for cmd in shell_blocks()
             for path in re.findall(r"(?<![\w/.-])((?:examples|helm|crds|bench|tests|tools)/[\w./-]*\w)", cmd)}
    assert "helm/stalwart/crds/trainingjob.yaml" in named, sorted(named)
    missing = sorted(path for path in named if not (REPO / path).exists())
    assert not missing, missing
