"""Print pip's effective package-source settings as ``export UV_...=...`` lines (shell-quoted), for uv.

uv does not read pip's configuration. scripts/build-env.sh evals these lines before hatch builds an environment
with uv, so a machine's pip settings (local wheel folders, mirrors, constraint files) still apply. pip's own
precedence decides: its environment variables, then the ``[install]`` section, then ``[global]`` (as
``pip config list`` reports them). A UV_ variable already set is left alone.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

# pip setting -> (uv variable, separator uv expects between several values)
UV_NAMES = {
    "find-links": ("UV_FIND_LINKS", ","),
    "index-url": ("UV_INDEX_URL", " "),
    "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
    "constraint": ("UV_CONSTRAINT", " "),
}
_RANK = {":env:": 0, "install": 1, "global": 2}


def pip_settings(listed: str) -> dict[str, str]:
    """The winning value of every setting in ``pip config list`` output (``section.name='value'`` lines)."""
    best: dict[str, tuple[int, str]] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if section in _RANK and (name not in best or _RANK[section] < best[name][0]):
            best[name] = (_RANK[section], value.strip().strip("'\""))
    return {name: value for name, (_, value) in best.items()}


def uv_exports(settings: dict[str, str], environ: dict[str, str]) -> list[str]:
    out = []
    for name, (var, sep) in UV_NAMES.items():
        if name in settings and not environ.get(var):
            out.append(f"export {var}={shlex.quote(sep.join(settings[name].split()))}")
    return out


def main() -> int:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=False).stdout
    print("\n".join(uv_exports(pip_settings(listed), dict(os.environ))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
