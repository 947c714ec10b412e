"""Fixtures for the monitor tests: offline backends in ``tmp_path`` and readers for what each backend wrote.

Everything runs offline: W&B in ``WANDB_MODE=offline``, Comet as an offline experiment with its error
reporting (which would try the network) switched off before ``comet_ml`` is first imported.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@pytest.fixture
def wandb_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """W&B writes offline runs under the returned directory (``$WANDB_DIR/wandb/offline-run-*``).

    wandb reads its environment once per process (at its first ``init``), so the fixture tears wandb down
    afterwards: the next test's ``WANDB_DIR`` is then read afresh.
    """
    wandb = pytest.importorskip("wandb")
    root = tmp_path / "wandb_dir"
    root.mkdir()
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_SILENT": "true",
                       "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true"}.items():
        monkeypatch.setenv(key, value)
    yield root
    wandb.teardown()


@pytest.fixture
def comet_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Comet offline experiments are archived (zip) in the returned directory."""
    root = tmp_path / "comet_offline"
    root.mkdir()
    for key, value in {"COMET_OFFLINE_DIRECTORY": str(root), "COMET_ERROR_TRACKING_ENABLE": "false",
                       "COMET_DISPLAY_SUMMARY_LEVEL": "0", "COMET_AUTO_LOG_ENV_DETAILS": "false",
                       "COMET_AUTO_LOG_GIT_METADATA": "false", "COMET_AUTO_LOG_CODE": "false",
                       "COMET_AUTO_LOG_ENV_HOST": "false"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("COMET_API_KEY", raising=False)
    pytest.importorskip("comet_ml")
    return root


def _wandb_log_records(path: str) -> list[bytes]:
    """The records of a ``.wandb`` file: a 7-byte header, then LevelDB-log blocks of 32 KiB."""
    data = Path(path).read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a W&B transaction log"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:  # full record
            records.append(chunk)
        elif kind in (2, 3):  # first, middle
            pending += chunk
        elif kind == 4:  # last
            records.append(pending + chunk)
            pending = b""
    return records


@pytest.fixture
def read_wandb() -> Callable[[Path], tuple[object, dict[int, dict[str, float]]]]:
    """Reader of the one offline run under a WANDB_DIR: (RunRecord, {step: {metric: value}})."""
    from wandb.proto import wandb_internal_pb2

    def read(root: Path) -> tuple[object, dict[int, dict[str, float]]]:
        files = glob.glob(os.path.join(root, "wandb", "offline-run-*", "run-*.wandb"))
        assert len(files) == 1, files
        records = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # wandb's service writes the log shortly after run.finish() returns
            records = [wandb_internal_pb2.Record.FromString(raw) for raw in _wandb_log_records(files[0])]
            if any(r.WhichOneof("record_type") == "exit" for r in records):
                break
            time.sleep(0.05)
        run, history = None, {}
        for record in records:
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
            elif kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                history[record.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
        return run, history

    return read


@pytest.fixture
def read_comet() -> Callable[[Path], tuple[list[dict], list[str]]]:
    """Reader of the offline archive(s) in a directory: (metric payloads in order, every file's text)."""

    def read(root: Path) -> tuple[list[dict], list[str]]:
        archives = sorted(root.glob("*.zip"))
        assert len(archives) == 1, archives
        metrics, texts = [], []
        with zipfile.ZipFile(archives[0]) as archive:
            for name in archive.namelist():
                text = archive.read(name).decode("utf-8", "replace")
                texts.append(text)
                if name.endswith("messages.json"):
                    for line in text.splitlines():
                        message = json.loads(line)
                        if message["type"] == "metric_msg":
                            metrics.append(message["payload"]["metric"])
        return metrics, texts

    return read


@pytest.fixture
def read_tensorboard() -> Callable[[Path], dict[str, list[tuple[int, float]]]]:
    """Reader of every event file in a log directory: {tag: [(step, value), ...]} via tensorboard's own loader."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def read(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
        accumulator = EventAccumulator(str(log_dir))
        accumulator.Reload()
        return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
                for tag in accumulator.Tags()["scalars"]}

    return read
