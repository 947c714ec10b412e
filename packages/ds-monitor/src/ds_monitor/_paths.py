"""Where the file-based monitors write: ``output_path/job_name``, relative paths under the launch directory."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["JobDirAttributes", "job_dir"]


def job_dir(output_path: str, job_name: str, section: str) -> str:
    """Absolute ``output_path/job_name``; an empty ``output_path`` means the current (launch) directory.

    Resolved once at start-up so that a later ``os.chdir`` in the training script does not move the logs.
    """
    if not job_name or os.path.isabs(job_name) or ".." in job_name.replace("\\", "/").split("/"):
        raise ValueError(f"{section}.job_name={job_name!r}: expected a non-empty relative directory name "
                         "(it becomes a sub-directory of output_path)")
    base = os.path.expanduser(output_path) if output_path else os.getcwd()
    return os.path.abspath(os.path.join(base, job_name))


class JobDirAttributes:
    """DeepSpeed's ``output_path`` / ``job_name`` attributes of its file-based monitors, read from the config."""

    monitor_config: Any

    @property
    def output_path(self) -> str:
        """Root folder of the files (DeepSpeed's attribute; the config's ``output_path``)."""
        return self.monitor_config.output_path

    @property
    def job_name(self) -> str:
        """Subfolder of ``output_path`` for this job (DeepSpeed's attribute; the config's ``job_name``)."""
        return self.monitor_config.job_name
