"""``BaseFileWriter``: what every writer handed to ``torch.save`` shares: the path and the statistics."""

from __future__ import annotations

from deepspeed.io.constants import (
    CLOSE_COUNT_KEY,
    FILE_PATH_KEY,
    FILENO_COUNT_KEY,
    FLUSH_COUNT_KEY,
    WRITE_BYTES_KEY,
    WRITE_COUNT_KEY,
    WRITE_SEC_KEY,
    WRITE_SPEED_KEY,
)

BASE_STAT_KEYS = [CLOSE_COUNT_KEY, FILENO_COUNT_KEY, FLUSH_COUNT_KEY, WRITE_COUNT_KEY, WRITE_BYTES_KEY, WRITE_SEC_KEY,
                  WRITE_SPEED_KEY]


class BaseFileWriter:
    """A file-like object ``torch.save`` writes through: ``write(bytes)``, ``flush()``, ``fileno()``, ``close()``.
    ``_stats`` counts calls, bytes and seconds (keys in ``deepspeed.io.constants``)."""

    def __init__(self, file_path: str) -> None:
        self._file_path = str(file_path)
        self._stats: dict[str, float | str] = dict.fromkeys(BASE_STAT_KEYS, 0)

    def close(self) -> None:
        pass

    def fileno(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} does not say how to name its descriptor")

    def flush(self) -> None:
        pass

    def write(self, buffer: bytes) -> int:
        raise NotImplementedError(f"{type(self).__name__} does not say how to write")

    def file_path(self) -> str:
        return self._file_path

    def _incr_stats(self, key: str, incr: float = 1) -> None:
        self._stats[key] += incr

    def _dump_state(self) -> dict[str, float | str]:
        """The statistics (write speed in GiB/s filled in), printed and returned."""
        if self._stats[WRITE_SEC_KEY] > 0:
            self._stats[WRITE_SPEED_KEY] = self._stats[WRITE_BYTES_KEY] / self._stats[WRITE_SEC_KEY] / (1 << 30)
        self._stats[FILE_PATH_KEY] = self.file_path()
        print(f"stats = {self._stats}")
        return self._stats
