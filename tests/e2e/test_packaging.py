"""The package as a user installs it: the sdist and wheel build (the wheel from the sdist, as
``python -m build`` does, so a file the sdist forgets fails here), the wheel holds the package
alone, and ``pip install`` of it into an empty virtual environment brings the runtime's
dependencies and none of an extra's (pyproject.toml's ``optional-dependencies``), with the
console script working.

Needs pip to reach a package index (or its cache) for setuptools and the runtime's dependencies.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _name(requirement: str) -> str:
    """The normalised distribution name of a PEP 508 requirement (PEP 503: lower case, runs of
    ``-_.`` as one ``-``)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group()).lower()


def _extras_only() -> set[str]:
    """Distributions some extra asks for and the runtime does not."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_name(r) for r in project["dependencies"]}
    extras = {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    return extras - runtime - {_name(project["name"])}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


def test_the_sdist_and_wheel_build_and_the_wheel_holds_the_package_alone(built):
    [sdist] = built.glob("prefix_router-*.tar.gz")
    [wheel] = built.glob("prefix_router-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert "prefix_router" in top
    assert top - {"prefix_router"} == {n for n in top if n.endswith(".dist-info")}, top
    assert "prefix_router/cli.py" in names and "prefix_router/tools/sim/server.py" in names
    assert sdist.stat().st_size > 0


def test_the_wheel_installs_the_runtime_alone_into_an_empty_venv(built, tmp_path):
    [wheel] = built.glob("prefix_router-*.whl")
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    pip = subprocess.run([str(env / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", str(wheel)],
                         capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, pip.stderr[-3000:]
    listed = subprocess.run([str(env / "bin" / "pip"), "list", "--format=freeze"], capture_output=True, text=True,
                            check=True).stdout
    installed = {_name(line) for line in listed.splitlines() if line.strip()}
    unwanted = _extras_only()
    assert unwanted, "pyproject.toml lists no extra"
    assert not installed & unwanted, f"extras' dependencies installed with the runtime: {sorted(installed & unwanted)}"
    for command in (["serve", "--help"], ["--help"], ["sim", "--help"]):
        run = subprocess.run([str(env / "bin" / "prefix-router"), *command], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, (command, run.stderr[-2000:])
    assert "--replica" in subprocess.run([str(env / "bin" / "prefix-router"), "serve", "--help"],
                                         capture_output=True, text=True).stdout
