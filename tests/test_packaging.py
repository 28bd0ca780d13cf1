"""The wheel as a user gets it: built from the checkout's files (tracked and new, as ``git ls-files``
lists them) in a fresh directory, since an in-tree build would ship stale modules from ``build/``;
installed into a directory of its own, then run from outside the checkout so that nothing is
imported from the repository."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str]:
    """The wheel built from a copy of the checkout, and the build's output."""
    source, dist = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():  # a file deleted but not yet committed is listed too
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # its notes are not warnings
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w", dist, source],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    [path] = dist.glob("rest_spec-*.whl")
    return path, build.stdout + build.stderr


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed, without its dependencies (this environment has them), into a directory."""
    target = tmp_path_factory.mktemp("installed")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", target, wheel[0]],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


def outside(installed: Path, cwd: Path, *command: str) -> subprocess.CompletedProcess:
    """``command`` run from ``cwd``, with the installed wheel ahead of this environment's packages."""
    env = {**os.environ, "PYTHONPATH": str(installed)}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_building_the_wheel_prints_no_warnings(wheel):
    warnings = [line for line in wheel[1].splitlines() if "warning" in line.lower()]
    assert warnings == []


def test_the_wheel_adds_one_import_name_and_ships_the_license(wheel):
    with zipfile.ZipFile(wheel[0]) as archive:
        names = archive.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/RECORD"))
        assert archive.read(f"{info}/top_level.txt").decode().split() == ["rest_spec"]
        assert archive.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    assert {n.split("/")[0] for n in names} == {"rest_spec", info}
    assert "rest_spec/proto/v1/datastore.proto" in names


def test_the_installed_package_imports_from_its_own_directory(installed, tmp_path):
    code = (
        "import rest_spec, rest_spec.datastore.server, rest_spec.drafter.cli.rest_generate; print(rest_spec.__file__)"
    )
    result = outside(installed, tmp_path, sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).is_relative_to(installed)


def test_each_console_script_runs_outside_the_checkout(wheel, installed, tmp_path):
    with zipfile.ZipFile(wheel[0]) as archive:
        [name] = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        entry_points = configparser.ConfigParser()
        entry_points.read_string(archive.read(name).decode())
    scripts = list(entry_points["console_scripts"])
    assert sorted(scripts) == [
        "build_index",
        "rest-chat",
        "rest-datastore",
        "rest-fill-outputs",
        "rest-generate",
        "rest-measure-cost",
    ]
    for script in scripts:
        result = outside(installed, tmp_path, str(installed / "bin" / script), "--help")
        assert result.returncode == 0, f"{script}: {result.stderr}"
        assert result.stdout.startswith(f"usage: {script} "), script
