"""The ``Monitor`` base class: one backend, written on global rank 0 only, never failing the training step."""

from __future__ import annotations

import abc
import contextlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from ds_config import DSConfigModel, validate_section
from ds_monitor._events import Event, normalize_events, redact
from ds_monitor._rank import resolve_rank
from ds_monitor.utils import BACKENDS, MonitorBackendMissing, require_backend

__all__ = ["Monitor", "MonitorStartError", "coerce_section"]

logger = logging.getLogger("ds_monitor")


class MonitorStartError(RuntimeError):
    """An enabled monitor could not start (bad settings, backend refused); raised at start-up only."""


def coerce_section(config: Any, model: type[DSConfigModel], section: str) -> DSConfigModel:
    """``config`` as ``model``: an instance as is, a mapping validated (errors name ``section.key``)."""
    if isinstance(config, model):
        return config
    if config is None or isinstance(config, Mapping):
        return validate_section(model, config, path=section)
    raise TypeError(f"{section} config={config!r}: expected a {model.__name__} or a dict")


class Monitor(abc.ABC):
    """One monitoring backend configured by its typed config section.

    Only global rank 0 opens the backend and writes (``rank`` as in :func:`~ds_monitor._rank.resolve_rank`:
    explicit, else torch.distributed when initialised, else ``$RANK``, else 0). Every enabled monitor checks at
    start-up, on every rank, that its package is installed. At run time a failing backend logs one warning
    (counted in ``failures``) and the training step goes on.
    """

    section: ClassVar[str]
    """The config key of this monitor (``tensorboard``, ``wandb``, ``comet``, ``csv_monitor``)."""
    config_model: ClassVar[type[DSConfigModel]]

    def __init__(self, monitor_config: Any, rank: int | None = None) -> None:
        self.monitor_config = coerce_section(monitor_config, self.config_model, self.section)
        self.enabled: bool = bool(self.monitor_config.enabled)
        self.rank = resolve_rank(rank)
        self.failures = 0
        self._warned = False
        self._closed = False
        if self.enabled and self.section in BACKENDS:
            require_backend(self.section)
        if self.active:
            self._start()

    @property
    def active(self) -> bool:
        """True when this process writes: the monitor is enabled, not closed, and this is global rank 0."""
        return self.enabled and self.rank == 0 and not self._closed

    def write_events(self, event_list: Iterable[Event]) -> None:
        """Record ``[(name, value, step), ...]``; a malformed event raises, a backend failure only warns."""
        if not self.active:
            return
        events = normalize_events(event_list)
        if events:
            self._guarded("write events", self._write, events)

    def flush(self) -> None:
        """Push buffered events to the backend (files on disk, the backend's own uploader)."""
        if self.active:
            self._guarded("flush", self._flush)

    def close(self) -> None:
        """Flush and release the backend (file, run, experiment); later writes are ignored. Idempotent."""
        if self.active:
            self._guarded("close", self._close)
        self._closed = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(enabled={self.enabled}, rank={self.rank}, active={self.active})"

    # -- for subclasses --------------------------------------------------------------------------------------

    @abc.abstractmethod
    def _open(self) -> None:
        """Open the backend (rank 0, enabled); exceptions become :class:`MonitorStartError`."""

    @abc.abstractmethod
    def _write(self, events: list[Event]) -> None:
        """Send checked events to the backend; may raise (the caller warns once)."""

    def _flush(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Nothing to flush unless the backend buffers."""

    def _close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Nothing to release unless the backend holds a resource."""

    def _secrets(self) -> tuple[str, ...]:
        """Strings that must never reach a log line or an exception message."""
        return ()

    # -- internals -------------------------------------------------------------------------------------------

    def _start(self) -> None:
        try:
            self._open()
            return
        except MonitorBackendMissing:
            raise
        except Exception as exc:
            with contextlib.suppress(Exception):  # release what _open got before it failed (a run, a file)
                self._close()
            detail = redact(f"{type(exc).__name__}: {exc}", self._secrets())
            error = MonitorStartError(f"the {self.section} monitor ('{self.section}.enabled' is true) could not "
                                      f"start: {detail}")
            if not self._secrets():
                raise error from exc
        # raised outside the except block so that the backend's exception (it may quote a secret) is not chained
        raise error

    def _guarded(self, what: str, call: Any, *args: Any) -> None:
        try:
            call(*args)
        except Exception as exc:
            self.failures += 1
            if not self._warned:
                self._warned = True
                logger.warning("%s monitor failed to %s (%s); training continues, further failures of this monitor "
                               "are counted in .failures but not logged",
                               self.section, what, redact(f"{type(exc).__name__}: {exc}", self._secrets()))
