"""``deepspeed.runtime.sequence_parallel``: DeepSpeed's module path for sequence-parallel process groups.

``parallel_state_sp`` is a module-level mpu with a sequence axis (pass the module itself as ``mpu=`` to
``deepspeed.initialize``). ``ulysses_sp`` (Arctic Long Sequence Training) is not built in this version: importing
it raises an error naming the feature.
"""
