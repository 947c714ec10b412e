"""Mixed-precision training shared by the engine, the pipeline engine and DeepSpeed's legacy optimizer classes:
the loss scalers (``loss_scalers``) and the optimizer wrappers that keep fp32 master weights (``optimizers``).

Where precision plugs into the engine (which scaler, which dtypes a config asks for) is ``runtime.engine._precision``.
"""
