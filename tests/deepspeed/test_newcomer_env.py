"""The first-run environment build (issue 28): scripts/hatch knows which environment a command needs, and
scripts/pip_to_uv.py hands pip's package sources on to uv (which hatch.toml's installer uses) by pip's precedence."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("pip_to_uv", ROOT / "scripts" / "pip_to_uv.py")
pip_to_uv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pip_to_uv)


def test_pip_precedence_environment_then_install_then_global():
    listed = "\n".join([
        ":env:.find-links='/env/wheels'",
        "global.find-links='/global/wheels'",
        "global.index-url='https://mirror.example/simple'",
        "install.index-url='https://install.example/simple'",
        "global.extra-index-url='file:///a/simple file:///b/simple'",
        "global.timeout='60'",
    ])
    assert pip_to_uv.pip_settings(listed) == {
        "find-links": "/env/wheels", "index-url": "https://install.example/simple",
        "extra-index-url": "file:///a/simple file:///b/simple", "timeout": "60"}


def test_uv_exports_use_uvs_separators_and_leave_set_variables_alone():
    settings = {"find-links": "/w1 /w2", "extra-index-url": "file:///a/simple file:///b/simple",
                "constraint": "/etc/pip constraints.txt", "timeout": "60"}
    assert pip_to_uv.uv_exports(settings, {"UV_CONSTRAINT": "/mine.txt"}) == [
        "export UV_FIND_LINKS=/w1,/w2",  # uv: comma-separated
        "export UV_EXTRA_INDEX_URL='file:///a/simple file:///b/simple'",  # uv: space-separated, shell-quoted
    ]


def test_reads_pips_real_configuration(tmp_path):
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nfind-links = /from/file\nconstraint = /caps.txt\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    # only this file: no site-wide (XDG_CONFIG_DIRS) or user (HOME) configuration of the machine running the test
    env.update(PIP_CONFIG_FILE=str(conf), PIP_FIND_LINKS="/from/env", XDG_CONFIG_DIRS=str(tmp_path / "none"),
               HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "none"))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "pip_to_uv.py")], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert "export UV_FIND_LINKS=/from/env" in out.splitlines()  # pip's environment variable beats its file
    assert "export UV_CONSTRAINT=/caps.txt" in out.splitlines()


@pytest.mark.parametrize("args, env", [
    ("run main", "default"), ("run test:run -x", "test"), ("-e bench run python x.py", "bench"),
    ("shell", "default"), ("shell test", "test"), ("env create", "default"), ("env create test", "test"),
    ("env find", ""), ("--version", ""), ("run python -c 1", "default"),
])
def test_scripts_hatch_knows_the_environment_a_command_needs(args, env):
    source = (ROOT / "scripts" / "hatch").read_text()
    function = source[source.index("wanted_env() {"):source.index("\n}\n", source.index("wanted_env() {")) + 3]
    out = subprocess.run(["bash", "-c", f"{function}\nwanted_env {args}"], capture_output=True, text=True,
                         timeout=30, env={**os.environ, "HATCH_ENV": ""})
    assert out.stdout.strip() == env, out.stderr
