"""docker/Dockerfile, built where no Docker engine runs: its instructions read by
dockerfile-parse, its COPY steps laid out from the build context (less .dockerignore), its pip
step run in a clean venv of the base image's Python, and its default command started until the
HEALTHCHECK's URL answers. The chart's default image is this file; a step that no longer works
(a file the build needs not copied, an extra that is gone, a command the CLI refuses, a health
URL nobody serves) fails here instead of in a user's `docker build`."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

dfp = pytest.importorskip("dockerfile_parse", reason="dockerfile-parse (test extra) is not installed")

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
# What a RUN may do besides pip, that a venv cannot: the system packages and the user. A new kind
# of step fails the test until it is understood here.
SYSTEM_STEPS = ("apt-get ", "rm -rf /var/lib/apt/lists", "useradd ")


def _instructions() -> list[tuple[str, str]]:
    parser = dfp.DockerfileParser(path=str(DOCKERFILE))
    return [(i["instruction"], i["value"]) for i in parser.structure if i["instruction"] != "COMMENT"]


def _ignored(rel: str, patterns: list[str]) -> bool:
    parts = rel.split("/")
    for pat in patterns:
        pat = pat.rstrip("/").removeprefix("**/")
        if any(fnmatch.fnmatch(p, pat) for p in parts) or fnmatch.fnmatch(rel, pat):
            return True
    return False


def _dockerignore() -> list[str]:
    path = ROOT / ".dockerignore"
    lines = path.read_text().splitlines() if path.exists() else []
    return [x.strip() for x in lines if x.strip() and not x.startswith("#")]


def _copy(value: str, workdir: Path) -> None:
    *srcs, dest = shlex.split(value)
    target = workdir / dest
    patterns = _dockerignore()
    for src in srcs:
        s = ROOT / src
        assert s.exists(), f"COPY {src}: not in the build context"
        if s.is_dir():
            shutil.copytree(
                s,
                target if not dest.endswith("/") else target / s.name,
                ignore=lambda d, names: [n for n in names if _ignored(n, patterns)],
                dirs_exist_ok=True,
            )
        else:
            target.mkdir(parents=True, exist_ok=True) if dest.endswith("/") else None
            shutil.copy2(s, target / s.name if dest.endswith("/") else target)


def _base_python(image: str) -> str:
    m = re.fullmatch(r"python:(\d+\.\d+)[-\w.]*", image)
    assert m, f"FROM {image}: not an official python image this test knows how to stand in for"
    return m.group(1)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The Dockerfile's steps, in order, in a temporary root: what the image would hold."""
    root = tmp_path_factory.mktemp("image")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    state: dict = {"workdir": root, "env": env, "skipped": [], "exposed": set()}
    venv = root / "venv"
    for instruction, value in _instructions():
        if instruction == "FROM":
            version = _base_python(value)
            here = f"{sys.version_info.major}.{sys.version_info.minor}"
            if version != here:
                pytest.skip(f"the image's Python is {version}; this test runs on {here}")
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
        elif instruction == "ENV":
            for item in shlex.split(value):
                k, _, v = item.partition("=")
                env[k] = v
        elif instruction == "WORKDIR":
            state["workdir"] = root / value.lstrip("/")
            state["workdir"].mkdir(parents=True, exist_ok=True)
        elif instruction == "COPY":
            _copy(value, state["workdir"])
        elif instruction == "RUN":
            for step in (s.strip() for s in value.split("&&")):
                if step.startswith("pip "):
                    r = subprocess.run(
                        [str(venv / "bin" / "pip"), *shlex.split(step)[1:]],
                        cwd=state["workdir"],
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=600,
                    )
                    assert r.returncode == 0, f"RUN {step}:\n{r.stderr[-3000:]}"
                else:
                    assert step.startswith(SYSTEM_STEPS), f"RUN {step}: a step this check cannot stand in for"
                    state["skipped"].append(step)
        elif instruction == "EXPOSE":
            state["exposed"] |= {int(p.split("/")[0]) for p in value.split()}
        elif instruction in ("ENTRYPOINT", "CMD"):
            state[instruction] = json.loads(value)  # exec form: no shell between Docker and us
        elif instruction == "HEALTHCHECK":
            state["health"] = json.loads(value.split("CMD", 1)[1])
        elif instruction != "USER":
            raise AssertionError(f"{instruction}: an instruction this check does not know")
    return state


def test_the_image_installs_and_its_entrypoint_is_the_cli(built):
    r = subprocess.run(
        [*built["ENTRYPOINT"], "--version"], env=built["env"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "costexporter" in r.stdout, r.stderr
    # What the chart runs (the agent with NVML and the Kubernetes reader, the API, the watcher)
    # is installed: the [k8s] extra and the base dependencies import in the image's Python.
    probe = "import pynvml, redis, fastapi, uvicorn, prometheus_client, lightkube"
    r = subprocess.run(["python", "-c", probe], env=built["env"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert any(s.startswith("apt-get install") and "redis-server" in s for s in built["skipped"])


def test_the_default_command_serves_what_the_healthcheck_asks(built):
    """`docker run <image>`: the demo starts, and the HEALTHCHECK's URL (on an EXPOSEd port)
    answers; SIGTERM stops it cleanly."""
    url = built["env"]["COSTEXPORTER_HEALTH_URL"]
    port = int(re.search(r":(\d+)/", url).group(1))
    assert port in built["exposed"]
    assert shutil.which("redis-server"), "the image's redis-server (apt) stands in from this machine"
    proc = subprocess.Popen(
        [*built["ENTRYPOINT"], *built["CMD"]],
        cwd=built["workdir"],
        env=built["env"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            r = subprocess.run(built["health"], env=built["env"], capture_output=True, timeout=30)
            if r.returncode == 0:
                break
            assert time.monotonic() < deadline, r.stderr
            time.sleep(0.5)
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert b"costexporter_" in resp.read()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err[-3000:]
