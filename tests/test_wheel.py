"""A non-editable install works outside the source tree: build the wheel, install it into a
fresh virtual environment (dependencies reused from this one), run the CLIs from an empty
directory."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]



@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a clean copy: no build/ or egg-info of the working tree leaks in
    skip_top = {".git", "build", "dist", ".venv", "data", "runs", "logs", "tests", "benchmarks"}
    shutil.copytree(ROOT, src, ignore=lambda d, names: [
        n for n in names if (Path(d) == ROOT and n in skip_top) or n == "__pycache__"
        or n.endswith(".egg-info")])
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(tmp / "dist"), str(src)],
                           capture_output=True, text=True)
    if build.returncode != 0:
        pytest.fail(f"building the wheel failed:\n{build.stderr[-3000:]}")
    wheel = next((tmp / "dist").glob("tape_train-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                              "install", "--no-deps", "--no-index", "-q", str(wheel)],
                             capture_output=True, text=True, env=env)
    if install.returncode != 0:
        pytest.fail(f"installing the wheel failed:\n{install.stderr[-3000:]}")
    # Then reuse this interpreter's installed dependencies (a plain path entry: .pth files
    # there, such as an editable install of this repository, are not processed).
    parents = [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
    Path(purelib, "zz_parent_env.pth").write_text("\n".join(parents) + "\n")
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    workdir = tmp / "elsewhere"
    workdir.mkdir()
    return venv, env, workdir


def _run(wheel_env, *cmd: str) -> subprocess.CompletedProcess:
    venv, env, workdir = wheel_env
    exe = venv / "bin" / cmd[0]
    return subprocess.run([str(exe), *cmd[1:]], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=300)


def test_installed_package_is_the_wheel_and_carries_its_resources(wheel_env):
    venv, _, _ = wheel_env
    out = _run(wheel_env, "python", "-c",
               "import tape_train, tape_train.resources as r; print(tape_train.__file__); "
               "print(r.resource_dir('configs/model'))")
    assert out.returncode == 0, out.stderr
    module, model_dir = out.stdout.split()
    assert Path(module).is_relative_to(venv) and not Path(module).is_relative_to(ROOT)
    assert (Path(model_dir) / "tiny.yaml").is_file() and Path(model_dir).is_relative_to(venv)


def test_named_configs_and_templates_work_from_any_directory(wheel_env):
    cfg = _run(wheel_env, "tape-train", "--config", "demo", "--print-config")
    assert cfg.returncode == 0, cfg.stderr
    assert "hidden_size: 256" in cfg.stdout  # `base: tiny` resolved from the packaged sizes
    info = _run(wheel_env, "tape-model", "info", "tiny")
    assert info.returncode == 0 and "tiny pe=tape" in info.stdout, info.stderr
    submit = _run(wheel_env, "tape-submit", "--config", "demo", "--dry-run", "--no-preflight")
    assert submit.returncode == 0, submit.stderr
    assert "#SBATCH" in submit.stdout and "tape_train.train.cli" in submit.stdout
    missing = _run(wheel_env, "tape-train", "--config", "nosuch")
    assert missing.returncode == 1
    assert "shipped configs, usable by name: 125m, demo" in missing.stderr
    assert "Traceback" not in missing.stderr
