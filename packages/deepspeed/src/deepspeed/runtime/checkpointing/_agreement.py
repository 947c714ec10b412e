"""Agree, after each phase of a collective checkpoint call, whether every rank succeeded; else one error everywhere.

Why: a rank that fails alone (a damaged file, a full disk) and raises while the others go on leaves them waiting
in the next collective (a ZeRO all-gather, the next meeting) until a timeout that blames the wrong thing. So each
phase ends with one small exchange through the process group's store (``_sync.Meeting``): every rank posts "ok"
or a short description of its failure, and when any rank failed, every rank raises the same
:class:`CheckpointRankError` (chained to its own exception on the ranks that failed), within milliseconds of the
last rank's arrival. Phases: ``load_checkpoint`` reads and checks every file before it changes anything
("reading"), then applies ("loading"); ``save_checkpoint`` writes temporaries ("writing"), renames them into place
("committing"), then writes ``latest`` ("updating latest").

Message format (stable; the fault-injection tests match it)::

    <op> failed on ranks [<r>, ...] while <phase>: rank <r>: <file>: <cause>[; rank <r>: ...]. <consequence>
    (raised on every rank; this is rank <me>)

- ``<op>``: ``load_checkpoint`` or ``save_checkpoint``; ``<phase>`` as above.
- One ``rank <r>: ...`` entry per failing global rank, in rank order; ``<file>: `` is present when the failure
  concerns one file (the full path), absent otherwise.
- ``<cause>``: for a damaged file the reason alone: ``empty file (0 bytes)``, ``truncated (...)``, ``not a
  checkpoint file (<n> bytes; unpickling failed: ...)``, ``corrupt (...)``, ``missing (the file does not exist)``;
  for other errors ``<ExceptionType>: <message>``, an ``OSError`` with its errno name, e.g.
  ``OSError(ENOSPC): [Errno 28] No space left on device``. One line, at most :data:`MAX_CAUSE` characters.
- ``<consequence>``: what state the ranks are left in, e.g. ``Nothing was loaded on any rank.`` or ``Nothing was
  committed; 'latest' is unchanged.``

The exception's attributes carry the same facts: ``op``, ``phase``, ``rank``, ``failures`` (``{rank:
RankFailure(file, cause)}``). With one rank (no process group) a load raises the rank's own exception unchanged
(``CorruptCheckpointError``, ...), a save this format.
"""

from __future__ import annotations

import errno
import json
from typing import Any, NamedTuple

from deepspeed.runtime.checkpointing.errors import CheckpointRankError, CheckpointRankValueError

MAX_CAUSE = 600  # characters: keeps the store values small and the message readable
_OK = "ok"


class RankFailure(NamedTuple):
    """One rank's failure: the file it concerns (None when not one file) and the cause, one line."""

    file: str | None
    cause: str


def describe(error: BaseException) -> RankFailure:
    """The file and cause of ``error``: from its ``checkpoint_path`` / ``reason`` attributes when it has them
    (``load_file``'s errors, the readers' checks, the save's write errors), else its type and message."""
    path = getattr(error, "checkpoint_path", None)
    reason = getattr(error, "reason", None)
    if reason is None:
        kind = type(error).__name__
        code = getattr(error, "errno", None) if isinstance(error, OSError) else None
        if code in errno.errorcode:
            kind = f"{kind}({errno.errorcode[code]})"
        reason = f"{kind}: {error}" if str(error) else kind
    cause = " ".join(str(reason).split())
    if len(cause) > MAX_CAUSE:
        cause = cause[:MAX_CAUSE - 3] + "..."
    return RankFailure(None if path is None else str(path), cause)


def format_failures(op: str, phase: str, failures: dict[int, RankFailure], consequence: str, rank: int) -> str:
    """The message of :class:`CheckpointRankError` (format in the module docstring)."""
    entries = "; ".join(f"rank {r}: {f.file}: {f.cause}" if f.file else f"rank {r}: {f.cause}"
                        for r, f in sorted(failures.items()))
    return (f"{op} failed on ranks {sorted(failures)} while {phase}: {entries}. {consequence} "
            f"(raised on every rank; this is rank {rank})")


def agree(meeting: Any, op: str, phase: str, error: BaseException | None, consequence: str,
          alone_rank: int | None = None) -> None:
    """Share this rank's outcome of ``phase`` (``error`` or success); raise on every rank if any rank failed.

    ``meeting``: the call's ``_sync.Meeting``, or None with one rank: ``error`` is then re-raised as it is, or,
    given ``alone_rank``, as a :class:`CheckpointRankError` of that one rank (the save does so: a bare
    ``OSError`` would not say which file).
    """
    if meeting is None:
        if error is None:
            return
        if alone_rank is None:
            raise error
        failures = {alone_rank: describe(error)}
        raise CheckpointRankError(format_failures(op, phase, failures, consequence, alone_rank), op, phase,
                                  alone_rank, failures) from error
    outcome = _OK if error is None else json.dumps(describe(error)._asdict())
    statuses = meeting.exchange(phase, outcome, f"finish {phase} in {op}")
    failures = {rank: RankFailure(**json.loads(value)) for rank, value in statuses.items() if value != _OK}
    if failures:
        message = format_failures(op, phase, failures, consequence, meeting.rank)
        kind = CheckpointRankValueError if isinstance(error, ValueError) else CheckpointRankError
        raise kind(message, op, phase, meeting.rank, failures) from error
