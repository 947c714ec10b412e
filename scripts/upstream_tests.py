"""Per-file results of DeepSpeed's own unit tests, for ``scripts/upstream-tests.sh``.

Two roles, one file (stdlib only):
- a pytest plugin (``-p upstream_tests``, with this folder on PYTHONPATH) that appends one line per event to the
  file named by ``UPSTREAM_TESTS_EVENTS``, flushed at once, so a file killed for hanging still leaves the tests
  that finished and names the one that was running;
- a command line that turns a results folder (one ``<file>.events`` and ``<file>.status`` per test file) into the
  table, or puts two results folders side by side (ours vs real DeepSpeed).

Event lines (tab-separated): ``collected N``, ``collect_error <file> <first line>``, ``start <nodeid>``,
``end <outcome> <nodeid>``. A test with a ``start`` and no ``end`` was running when the file was killed: hung.

The plugin also keeps DeepSpeed's ``DistributedTest`` from hanging on a rank that ends in a pytest outcome
(``pytest.fail``, ``pytest.raises``' ``DID NOT RAISE``: ``BaseException``s, not ``Exception``s). Its pool worker
lets such an exception kill the worker process, the task's result never arrives, and the parent waits in
``AsyncResult.get`` until ``DS_UNITTEST_TIMEOUT`` and then ``pytest.exit``s the whole file. The plugin routes the
pool's task runner through :func:`_starmapstar`, which hands such an outcome back as a ``RuntimeError`` naming it,
so the test fails at once with the rank's message. Tests are run unmodified; both sides of a comparison get it.
"""

from __future__ import annotations

import argparse
import multiprocessing.pool
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

# --------------------------------------------------------------------------------------------- pytest plugin

_outcomes: dict[str, str] = {}


class RankOutcome(RuntimeError):
    """A rank's pytest outcome (a ``BaseException``) carried back to the parent as an ordinary exception."""


def _starmapstar(args: tuple) -> list:
    # Runs in the pool worker (pickled by reference: the worker imports this module from PYTHONPATH).
    func, arglist = args
    results = []
    for item in arglist:
        try:
            results.append(func(*item))
        except Exception:
            raise
        except BaseException as e:  # noqa: BLE001 - pytest outcomes; re-raising them would kill the worker
            if isinstance(e, KeyboardInterrupt):
                raise
            raise RankOutcome(f"rank {item[0] if item else '?'} ended with {type(e).__name__}: {e}") from None
    return results


def pytest_configure(config) -> None:  # noqa: ANN001
    # Pool looks the task runner up as a module global when it submits starmap work (DeepSpeed's launcher).
    multiprocessing.pool.starmapstar = _starmapstar


def _emit(*parts: object) -> None:
    path = os.environ.get("UPSTREAM_TESTS_EVENTS")
    if not path:
        return
    line = "\t".join(str(p).replace("\t", " ").replace("\n", " ") for p in parts)
    with open(path, "a", encoding="utf-8") as f:  # reopened each time: survives forks and a kill mid-file
        f.write(line + "\n")


def pytest_collection_finish(session) -> None:  # noqa: ANN001 - pytest hook
    _emit("collected", len(session.items))


def pytest_collectreport(report) -> None:  # noqa: ANN001
    if report.failed:
        text = str(report.longrepr).strip().splitlines()
        reason = next((ln for ln in reversed(text) if ln.startswith("E ")), text[-1] if text else "")
        _emit("collect_error", report.nodeid, reason[:300])


def pytest_runtest_logstart(nodeid, location) -> None:  # noqa: ANN001
    _emit("start", nodeid)


def pytest_runtest_logreport(report) -> None:  # noqa: ANN001
    # A test's outcome: failed if any phase failed, skipped if setup or call skipped, else passed.
    previous = _outcomes.get(report.nodeid)
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped and previous != "failed":
        _outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and previous is None:
        _outcomes[report.nodeid] = "passed"


def pytest_runtest_logfinish(nodeid, location) -> None:  # noqa: ANN001
    _emit("end", _outcomes.pop(nodeid, "failed"), nodeid)


# --------------------------------------------------------------------------------------------- summary

COLUMNS = ("collected", "passed", "failed", "skipped", "hung")


@dataclass
class FileResult:
    name: str
    collected: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    hung: int = 0
    seconds: float = 0.0
    note: str = ""
    hung_tests: list[str] = field(default_factory=list)

    @property
    def import_error(self) -> bool:
        return self.note.startswith("import:")


def read_file_result(results: Path, name: str) -> FileResult:
    stem = results / name.replace("/", "__")
    res = FileResult(name)
    status: dict[str, str] = {}
    status_path = stem.with_suffix(".status")
    if not status_path.exists() and not stem.with_suffix(".events").exists():
        res.note = "not run"
        return res
    if not status_path.exists():
        status["interrupted"] = "1"  # the run was stopped while this file ran: keep what finished
    if status_path.exists():
        for line in status_path.read_text().splitlines():
            key, _, value = line.partition("=")
            status[key] = value
    res.seconds = float(status.get("seconds", 0) or 0)
    started: list[str] = []
    finished: set[str] = set()
    events = stem.with_suffix(".events")
    for line in events.read_text(encoding="utf-8").splitlines() if events.exists() else []:
        parts = line.split("\t")
        if parts[0] == "collected":
            res.collected = int(parts[1])
        elif parts[0] == "collect_error":
            res.note = "import: " + parts[-1].removeprefix("E ").strip()
        elif parts[0] == "start":
            started.append(parts[1])
        elif parts[0] == "end":
            finished.add(parts[2])
            setattr(res, parts[1], getattr(res, parts[1]) + 1)
    if status.get("interrupted") == "1":
        res.note = f"run stopped during this file ({len(finished)} of {res.collected} tests finished)"
    elif status.get("timed_out") == "1" or status.get("pytest_exit") == "1":
        res.hung_tests = [t for t in started if t not in finished]
        res.hung = len(res.hung_tests) or 1
        if not res.note:
            res.note = "hung: " + (", ".join(t.split("::", 1)[-1] for t in res.hung_tests) or "(no test running)")
    elif not res.note and status.get("rc") not in (None, "0", "1", "5"):
        res.note = f"pytest exit {status.get('rc')}"
    return res


def read_results(results: Path) -> list[FileResult]:
    names = (results / "files.txt").read_text().split()
    return [read_file_result(results, n) for n in names]


def _totals(rows: list[FileResult]) -> dict[str, int]:
    totals = {c: sum(getattr(r, c) for r in rows) for c in COLUMNS}
    totals["import_errors"] = sum(r.import_error for r in rows)
    return totals


def table(rows: list[FileResult], markdown: bool) -> str:
    head = ["file", *COLUMNS, "s", "note"]
    body = [[r.name, *(str(getattr(r, c)) for c in COLUMNS), f"{r.seconds:.0f}", r.note[:110]] for r in rows]
    t = _totals(rows)
    body.append([f"total ({len(rows)} files, {t['import_errors']} stop at import)",
                 *(str(t[c]) for c in COLUMNS), f"{sum(r.seconds for r in rows):.0f}", ""])
    return _render(head, body, markdown)


def _cells(r: FileResult) -> list[str]:
    return [str(r.collected), str(r.passed), str(r.failed), str(r.skipped), str(r.hung)]


def compare(ours: list[FileResult], real: list[FileResult], markdown: bool, labels: tuple[str, str]) -> str:
    """One row per file of ``ours``: collected / passed / failed / skipped / hung on both sides, and the notes."""
    by_name = {r.name: r for r in real}
    a, b = labels
    cols = ("coll", "pass", "fail", "skip", "hung")
    head = ["file", *(f"{a} {c}" for c in cols), *(f"{b} {c}" for c in cols), f"{a} note", f"{b} note"]
    body = []
    for r in ours:
        o = by_name.get(r.name, FileResult(r.name, note="not run"))
        body.append([r.name, *_cells(r), *_cells(o), r.note[:80], o.note[:80]])
    both = [r for r in ours if r.note != "not run" and by_name.get(r.name, FileResult("", note="not run")).note
            != "not run"]
    ta, tb = _totals(both), _totals([by_name[r.name] for r in both])
    body.append([f"total, the {len(both)} files both ran", *(str(ta[c]) for c in COLUMNS),
                 *(str(tb[c]) for c in COLUMNS), f"{ta['import_errors']} stop at import",
                 f"{tb['import_errors']} stop at import"])
    return _render(head, body, markdown)


def _render(head: list[str], body: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    widths[-1] = 0  # the note runs free

    def fmt(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    return "\n".join(fmt(row).rstrip() for row in [head, *body])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summary", help="the table of one results folder")
    s.add_argument("results", type=Path)
    s.add_argument("--markdown", action="store_true")
    c = sub.add_parser("compare", help="two results folders side by side")
    c.add_argument("ours", type=Path)
    c.add_argument("real", type=Path)
    c.add_argument("--labels", default="ours,real")
    c.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    if args.cmd == "summary":
        print(table(read_results(args.results), args.markdown))
    else:
        labels = tuple(args.labels.split(",", 1))
        print(compare(read_results(args.ours), read_results(args.real), args.markdown, labels))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
