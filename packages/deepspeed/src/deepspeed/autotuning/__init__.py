"""DeepSpeed's Autotuner (spec 12): ``deepspeed --autotuning tune|run`` searches ZeRO stages, micro-batch sizes and
ZeRO knobs by running the user's script as short launcher jobs and keeps the fastest configuration.

Modules: :mod:`.autotuner` (the search), :mod:`.scheduler` (experiments as launcher jobs), :mod:`.tuner`
(grid, random and cost-model search over a tuning space), :mod:`.utils` (config-dict helpers), :mod:`.constants`
(templates and default tuning spaces). The engine side (metric and model-info files) is ``_probe``.
This package never imports torch except in ``_probe``, which runs inside the training ranks.
"""

from deepspeed.autotuning.autotuner import Autotuner

__all__ = ["Autotuner"]
