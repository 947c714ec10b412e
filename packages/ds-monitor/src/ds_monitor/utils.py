"""Backend availability checks and the Comet logging schedule (``deepspeed.monitor.utils``).

The backends are optional extras of ds-monitor; a monitor enabled without its package fails at start-up with
:class:`MonitorBackendMissing`, which names the extra to install.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = [
    "BACKENDS",
    "EventsLogScheduler",
    "MonitorBackendMissing",
    "check_comet_availability",
    "check_tb_availability",
    "check_wandb_availability",
    "import_backend",
    "require_backend",
]

BACKENDS: dict[str, tuple[str, str]] = {
    # config section -> (module to import, ds-monitor extra that installs it)
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "comet": ("comet_ml", "comet"),
}


class MonitorBackendMissing(ImportError):
    """A monitor is enabled but its backend package is not installed."""


def _missing(section: str, detail: str) -> MonitorBackendMissing:
    module, extra = BACKENDS[section]
    return MonitorBackendMissing(
        f"'{section}.enabled' is true but the '{module}' package {detail}; install it with "
        f"pip install 'ds-monitor[{extra}]' (or 'ds-monitor[all]'), or set '{section}.enabled' to false",
        name=module,
    )


def require_backend(section: str) -> None:
    """Raise :class:`MonitorBackendMissing` unless the package behind ``section`` is installed.

    Only locates the package (no import), so every rank can check cheaply and fail at start-up together.
    """
    if section not in BACKENDS:
        raise ValueError(f"section={section!r}: expected one of {sorted(BACKENDS)}")
    module = BACKENDS[section][0]
    try:
        found = importlib.util.find_spec(module) is not None
    except ValueError:  # already imported without a spec: importable
        found = True
    if not found:
        raise _missing(section, "is not installed")


# API a monitor needs that older releases lack: section -> attribute of the module
_REQUIRED_API = {"comet": "start"}


def import_backend(section: str) -> ModuleType:
    """Import the package behind ``section``; a failed import or a too-old release raises
    :class:`MonitorBackendMissing`."""
    require_backend(section)
    try:
        module = importlib.import_module(BACKENDS[section][0])
    except ImportError as exc:
        raise _missing(section, f"could not be imported ({type(exc).__name__}: {exc})") from exc
    needed = _REQUIRED_API.get(section)
    if needed and not hasattr(module, needed):
        version = getattr(module, "__version__", "?")
        raise _missing(section, f"{version} is too old (it has no {module.__name__}.{needed})")
    return module


def check_tb_availability() -> None:
    """Raise :class:`MonitorBackendMissing` unless ``tensorboard`` is installed."""
    require_backend("tensorboard")


def check_wandb_availability() -> None:
    """Raise :class:`MonitorBackendMissing` unless ``wandb`` is installed."""
    require_backend("wandb")


def check_comet_availability() -> None:
    """Raise :class:`MonitorBackendMissing` unless ``comet_ml`` is installed."""
    require_backend("comet")


class EventsLogScheduler:
    """Decides, per event name, whether a point is due: the first one, then one every ``samples_log_interval``.

    Comet bills and throttles by the number of points, hence ``comet.samples_log_interval`` (in samples).
    """

    def __init__(self, samples_log_interval: int) -> None:
        if isinstance(samples_log_interval, bool) or not isinstance(samples_log_interval, int) \
                or samples_log_interval < 1:
            raise ValueError(f"samples_log_interval={samples_log_interval!r}: expected a positive int (samples)")
        self.samples_log_interval = samples_log_interval
        self._last_logged: dict[str, int] = {}

    def needs_logging(self, name: str, current_sample: int) -> bool:
        """True (and remember it) when ``name`` was never logged or at least the interval has passed."""
        last = self._last_logged.get(name)
        # a step below the last one means training restarted from an earlier checkpoint: log again
        if last is not None and 0 <= current_sample - last < self.samples_log_interval:
            return False
        self._last_logged[name] = current_sample
        return True
