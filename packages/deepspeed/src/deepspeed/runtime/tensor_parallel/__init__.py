"""``deepspeed.runtime.tensor_parallel``: DeepSpeed's module path for AutoTP training helpers.

``config._get_hf_tp_plan(model)`` reads a Hugging Face model's tensor-parallel plan. The AutoTP training
machinery itself lives in :mod:`deepspeed.runtime.autotp` (the engine's ``tensor_parallel`` section).
"""
