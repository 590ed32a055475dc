"""The container image: Docker has no engine on the build machines, so the Dockerfile is checked by reading
it: its stages, the pinned base, the non-root user, what each final stage carries, and that every file it
copies is in the build context."""

from __future__ import annotations

import fnmatch
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
BUILD_TOOLS = {"gcc", "g++", "make", "build-essential", "clang", "cmake", "git", "curl", "wget"}


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


def parse_dockerfile(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults and the stages by name, instructions with line continuations joined."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical:
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            words = rest.split()
            assert len(words) == 3 and words[1].upper() == "AS", f"every stage is named: {line}"
            base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), words[0])
            current = Stage(words[2], base)
            stages[current.name] = current
        elif current is None:
            assert op == "ARG", f"only ARG may precede the first FROM: {line}"
            name, _, default = rest.partition("=")
            args[name] = default
        else:
            current.instructions.append((op, rest.strip()))
    return args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    return parse_dockerfile((REPO / "Dockerfile").read_text())


def ancestry(stages: dict[str, Stage], name: str) -> list[Stage]:
    chain = [stages[name]]
    while chain[-1].base in stages:
        chain.append(stages[chain[-1].base])
    return chain


def test_targets_exist_and_bases_are_pinned_by_digest(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    _, stages = dockerfile
    assert {"operator", "trainer"} <= set(stages)
    for stage in stages.values():
        if stage.base not in stages:
            assert DIGEST.search(stage.base), f"stage {stage.name} starts from an unpinned image {stage.base}"
            assert stage.base.startswith("python:3.11-slim@")


@pytest.mark.parametrize("target", ["operator", "trainer"])
def test_final_stages_run_as_non_root(dockerfile: tuple[dict[str, str], dict[str, Stage]], target: str) -> None:
    _, stages = dockerfile
    users = [u for stage in reversed(ancestry(stages, target)) for u in stage.all("USER")]
    assert users, f"{target} sets no USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}
    # The chart's securityContext runs as the image's user.
    values = yaml.safe_load((REPO / "helm" / "stalwart" / "values.yaml").read_text())
    assert int(user) == values["operator"]["podSecurityContext"]["runAsUser"]


@pytest.mark.parametrize("target", ["operator", "trainer"])
def test_final_stages_carry_no_build_tools(dockerfile: tuple[dict[str, str], dict[str, Stage]], target: str) -> None:
    _, stages = dockerfile
    for stage in ancestry(stages, target):
        for run in stage.all("RUN"):
            words = set(shlex.split(run))
            assert not (words & BUILD_TOOLS), f"{stage.name} installs build tools: {run}"
            assert "pip" not in words and "install" not in words, f"{stage.name} installs packages: {run}"


def test_operator_has_no_torch_and_trainer_has_cpu_torch(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    _, stages = dockerfile
    operator_sources = {c.split("--from=")[1].split()[0] for c in stages["operator"].all("COPY") if "--from=" in c}
    assert operator_sources == {"operator-env"}
    assert all("torch" not in run for s in ancestry(stages, "operator-env") for run in s.all("RUN"))
    trainer_env = " ".join(stages["trainer-env"].all("RUN") + stages["trainer-env"].all("ARG"))
    assert "torch==${TORCH_VERSION}" in trainer_env and "TORCH_VERSION=2.13.0" in trainer_env
    assert "download.pytorch.org/whl/cpu" in trainer_env
    assert stages["operator"].all("ENTRYPOINT") == ['["stalwart"]']


def ignored(path: str, patterns: list[str]) -> bool:
    """The .dockerignore decision for one path: the last matching pattern wins, `!` re-includes."""
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatchcase(p, pat) or fnmatch.fnmatchcase(p, pat.replace("**/", "")) for p in prefixes) \
                or pat == "**":
            excluded = not negate
    return excluded


def test_every_copied_file_is_in_the_build_context(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    _, stages = dockerfile
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    assert ignored(".venv/bin/python", patterns) and ignored(".git/HEAD", patterns)
    assert ignored("stalwart/__pycache__/x.pyc", patterns)
    for stage in stages.values():
        for copy in stage.all("COPY"):
            if "--from=" in copy:
                continue
            *sources, _dest = copy.split()
            for source in sources:
                matches = list(REPO.glob(source))
                assert matches, f"{stage.name}: COPY {source} matches nothing"
                for match in matches:
                    rel = match.relative_to(REPO).as_posix()
                    assert not ignored(rel, patterns), f"{rel} is copied but .dockerignore leaves it out"


def test_the_chart_and_the_examples_name_the_images_the_dockerfile_builds() -> None:
    """The build commands at the top of the Dockerfile tag the two targets; the chart runs the operator one
    and the example TrainingJobs the trainer one."""
    header = (REPO / "Dockerfile").read_text()
    tags = dict(re.findall(r"docker build --target (\w+)\s+-t (\S+) \.", header))
    assert set(tags) == {"operator", "trainer"}
    chart = yaml.safe_load((REPO / "helm" / "stalwart" / "Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "helm" / "stalwart" / "values.yaml").read_text())
    assert tags["operator"] == f"{values['image']['repository']}:{chart['appVersion']}"
    for manifest in sorted((REPO / "examples").glob("*.yaml")):
        for job in yaml.safe_load_all(manifest.read_text()):
            for container in job["spec"]["template"]["spec"]["containers"]:
                assert container["image"] == tags["trainer"], f"{manifest.name}: {container['image']}"


def test_the_operator_image_default_command_is_a_valid_stalwart_command(
        dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    import json

    from stalwart.cli import build_parser

    _, stages = dockerfile
    (cmd,) = stages["operator"].all("CMD")
    args = build_parser().parse_args(json.loads(cmd))
    assert args.command == "operator" and args.all_namespaces
