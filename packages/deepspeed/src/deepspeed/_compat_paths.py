"""Every documented DeepSpeed module path that a component package serves, as one table.

Key: the module path existing DeepSpeed scripts import. Value: the module that provides its names.
Issues that add a component add its rows here; ``tests/deepspeed/test_compat_paths.py`` imports every row.
Paths the meta-package implements itself (``deepspeed.runtime.engine``, ...) are real modules, not rows.
"""

COMPAT_PATHS: dict[str, str] = {
    # configuration (ds-config)
    "deepspeed.runtime.config": "ds_config.config",
    "deepspeed.runtime.zero.config": "ds_config.zero",
    "deepspeed.runtime.zero.offload_config": "ds_config.zero",
    "deepspeed.inference.config": "ds_config.inference",
    "deepspeed.monitor.config": "ds_config.monitor",
}
