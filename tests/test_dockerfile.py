"""The Dockerfile, checked by parsing (no Docker daemon here): stages, users, entrypoints, pins, context."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
FINAL = ("runtime", "operator")
BUILD_TOOLS = {"build-essential", "g++", "make", "cmake", "git", "ninja-build", "curl", "wget"}


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


def parse(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults and the stages by name, with continuation lines joined."""
    joined = re.sub(r"\\\n", " ", text)
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "ARG" and current is None:
            name, _, default = rest.partition("=")
            args[name] = default
        elif op == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest, re.IGNORECASE)
            assert m, f"every stage is named: FROM {rest}"
            base = re.sub(r"\$\{(\w+)\}", lambda v: args[v.group(1)], m.group(1))
            current = stages[m.group(2)] = Stage(m.group(2), base)
        else:
            assert current is not None, f"{op} before the first FROM"
            current.instructions.append((op, rest))
    return args, stages


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return parse((REPO / "Dockerfile").read_text())[1]


def test_final_stages_exist_and_are_built_from_pinned_bases(stages: dict[str, Stage]) -> None:
    assert set(FINAL) <= set(stages)
    assert "nvidia/cuda:" in stages["runtime"].base, "the runtime image is CUDA-based"
    assert stages["operator"].base.startswith("python:") and "slim" in stages["operator"].base
    for stage in stages.values():
        image, _, tag = stage.base.partition(":")
        if image in stages:     # FROM an earlier stage
            continue
        assert re.search(r"\d+\.\d+", tag) and "latest" not in tag, f"{stage.name}: unpinned base {stage.base}"


def test_entrypoints_are_console_scripts_of_the_package(stages: dict[str, Stage]) -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    expected = {"runtime": "kvfleet", "operator": "kvfleet-operator"}
    for name, script in expected.items():
        entrypoint, = stages[name].all("ENTRYPOINT")
        assert json.loads(entrypoint) == [script]       # exec form: signals reach the process
        assert script in scripts
        module, _, func = scripts[script].partition(":")
        source = REPO / {"kvfleet_runtime": "runtime", "kvfleet_operator": "operator"}[module.split(".")[0]]
        path = source / (module.replace(".", "/") + ".py")
        assert re.search(rf"^def {func}\(", path.read_text(), re.MULTILINE), f"{scripts[script]} not found"


def test_final_stages_run_as_a_non_root_user(stages: dict[str, Stage]) -> None:
    for name in FINAL:
        users = stages[name].all("USER")
        assert users, f"{name} has no USER"
        uid = users[-1].split(":")[0]
        assert uid.isdigit() and int(uid) != 0, f"{name}: USER {users[-1]} (numeric, so runAsNonRoot can check it)"


def test_no_build_tools_in_final_stages(stages: dict[str, Stage]) -> None:
    for name in FINAL:
        for run in stages[name].all("RUN"):
            for word in shlex.split(run):
                assert word not in BUILD_TOOLS, f"{name} installs {word}"
                assert not re.search(r"(^|/)pip3?$", word), f"{name} runs pip: install in a build stage"
        # only finished virtualenvs come from the build stages
        for copy in stages[name].all("COPY"):
            assert copy.startswith("--from="), f"{name} copies build context: {copy}"
    # Triton compiles its launcher at run time: gcc only where Triton runs.
    assert "gcc" in " ".join(stages["runtime"].all("RUN"))
    assert "gcc" not in " ".join(stages["operator"].all("RUN"))


def pinned_requirements(stage: Stage) -> dict[str, str]:
    pins: dict[str, str] = {}
    for run in stage.all("RUN"):
        for command in run.split("&&"):
            words = shlex.split(command)
            is_pip = bool(words) and (words[0].endswith("pip") or "pip" in words[1:3])
            if not is_pip or "install" not in words:
                continue
            for word in words[words.index("install") + 1:]:
                if word.startswith("-") or word.startswith("https://") or word.startswith("/"):
                    continue
                name, sep, version = word.partition("==")
                assert sep and re.fullmatch(r"[\w.+]+", version), f"{stage.name}: unpinned {word}"
                pins[name.lower().replace("_", "-")] = version
    return pins


def requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def test_every_pip_install_is_pinned_and_covers_the_extras(stages: dict[str, Stage]) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    runtime_pins = pinned_requirements(stages["runtime-venv"])
    operator_pins = pinned_requirements(stages["operator-venv"])
    pinned_requirements(stages["wheel"])
    base = requirement_names(project["dependencies"])
    assert requirement_names(extras["runtime"]) | base <= set(runtime_pins), "runtime extra drifted from the pins"
    assert requirement_names(extras["operator"]) | base <= set(operator_pins), "operator extra drifted from the pins"
    assert "torch" not in operator_pins, "the operator image stays slim"


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p.removeprefix("**/"))
               or path.split("/")[0] == p for p in patterns)


def test_build_context_has_what_copy_needs_and_no_heavy_folders(stages: dict[str, Stage]) -> None:
    patterns = dockerignore_patterns()
    for stage in stages.values():
        for copy in stage.all("COPY"):
            if copy.startswith("--from="):
                continue
            *sources, _dest = copy.split()
            for src in sources:
                assert (REPO / src).exists(), f"COPY {src}: not in the repository"
                assert not ignored(src, patterns), f"COPY {src} is excluded by .dockerignore"
    for heavy in (".git", ".venv", ".tools", "tests", "runtime/x/__pycache__"):
        assert ignored(heavy, patterns), f"{heavy} would be sent to the Docker daemon"
