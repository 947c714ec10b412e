"""Every test that reads the reference documents finds them the same way (``tests/_spec_docs.py``): next to the
repository (``../shared/spec``) or through ``DS_SPEC_DIR``; a missing spec skips locally and fails in CI."""

from __future__ import annotations

import re
from pathlib import Path

import _spec_docs
import pytest
from _spec_docs import require_spec, spec_dir

TESTS = Path(__file__).resolve().parents[1]


def test_default_location_is_next_to_the_repository_root(monkeypatch):
    monkeypatch.delenv("DS_SPEC_DIR", raising=False)
    assert (_spec_docs.REPO_ROOT / "pytest.ini").is_file()  # the helper's idea of the root is the root
    assert spec_dir() == _spec_docs.REPO_ROOT.parent / "shared" / "spec"


def test_env_var_overrides_the_location(monkeypatch, tmp_path):
    (tmp_path / "api-reference.txt").write_text("x")
    monkeypatch.setenv("DS_SPEC_DIR", str(tmp_path))
    assert spec_dir() == tmp_path.resolve()
    assert require_spec("api-reference.txt") == tmp_path.resolve()


@pytest.mark.parametrize("ci", ["true", "1", "TRUE"])
def test_missing_spec_fails_in_ci(monkeypatch, tmp_path, ci):
    monkeypatch.setenv("DS_SPEC_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match="nowhere not found.*CI=true, so this is a failure"):
        require_spec("api-reference.txt")


@pytest.mark.parametrize("ci", [None, "", "false", "0"])
def test_missing_spec_skips_locally_with_the_reason(monkeypatch, tmp_path, ci):
    monkeypatch.setenv("DS_SPEC_DIR", str(tmp_path))
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match=r"api-reference\.txt not found in .*set DS_SPEC_DIR"):
        require_spec("api-reference.txt")


def test_no_test_hard_codes_where_the_spec_is():
    offenders = []
    for path in TESTS.rglob("*.py"):
        if path.name == "_spec_docs.py" or path == Path(__file__).resolve():
            continue
        text = path.read_text()
        if re.search(r"[\"']/work/|\"shared\"\s*/\s*\"spec\"|shared/spec\"|DS_SPEC_DIR\"", text):
            offenders.append(str(path.relative_to(TESTS)))
    assert offenders == [], "locate the spec with _spec_docs.require_spec"
