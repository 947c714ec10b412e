"""The ``eigenvalue`` section in the engine: with it enabled, ``engine.backward`` builds the graph of the gradients
(``create_graph=True``, as DeepSpeed), and at every ``gas_boundary_resolution``-th accumulation boundary, before
the optimizer step, the Hessian eigenvalue of each block is estimated (``deepspeed.runtime.eigenvalue``), kept in
``engine.block_eigenvalue`` and written to the monitors as ``Train/Eigenvalues/ModelBlockParam_{i}``.

The estimate needs the gradients on the parameters: with ZeRO (stage >= 1) the section is refused at
``initialize``. DeepSpeed 0.19.6 computes them only for MoQ (``quantize_training``, whose quantizer it has
disabled), so there the section crashes at the first boundary; here the estimate runs and is reported
(docs/deviations.md).
"""

from __future__ import annotations

from typing import Any

from deepspeed.runtime.eigenvalue import Eigenvalue, eigenvalue_summary_events
from ds_config import ConfigError, ConfigProblem


def attach(engine: Any, config: Any) -> None:
    """Set ``engine.eigenvalue`` (None when the section is disabled), ``block_eigenvalue`` and the boundary count."""
    section = config.eigenvalue
    engine.eigenvalue = None
    engine.block_eigenvalue = None
    engine.gas_boundary_ctr = 0
    if section.enabled and config.zero_stage > 0:
        # ZeRO moves the gradients into its partitions (stage 1 accumulates them with out= additions, which
        # autograd refuses on a graph-carrying gradient); the power iteration needs them on the parameters.
        raise ConfigError(ConfigProblem("eigenvalue.enabled", "needs ZeRO stage 0 (the Hessian-vector products "
                                        "differentiate the gradients held on the parameters); zero_optimization."
                                        f"stage is {config.zero_stage}", True))
    if section.enabled:
        engine.eigenvalue = Eigenvalue(verbose=section.verbose, max_iter=section.max_iter, tol=section.tol,
                                       stability=section.stability,
                                       gas_boundary_resolution=section.gas_boundary_resolution,
                                       layer_name=section.layer_name, layer_num=section.layer_num)


def backward_kwargs(engine: Any, retain_graph: bool) -> dict[str, bool]:
    """``Tensor.backward`` keywords: the gradients' own graph is kept when eigenvalues will be estimated."""
    if getattr(engine, "eigenvalue", None) is None:
        return {"retain_graph": retain_graph}
    return {"retain_graph": True, "create_graph": True}


def at_boundary(engine: Any) -> None:
    """Count the boundary; on every ``gas_boundary_resolution``-th one estimate and report the eigenvalues."""
    engine.gas_boundary_ctr = getattr(engine, "gas_boundary_ctr", 0) + 1
    estimator = getattr(engine, "eigenvalue", None)
    if estimator is None or engine.gas_boundary_ctr % estimator.gas_boundary_resolution:
        return
    scale = engine.get_loss_scale() or 1.0
    engine.block_eigenvalue = estimator.compute_eigenvalue(engine.module, None, scale)
    if engine.monitor is not None and engine.global_rank == 0 and engine.block_eigenvalue:
        engine.monitor.write_events(eigenvalue_summary_events(engine.block_eigenvalue, engine.global_samples))
