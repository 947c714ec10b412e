"""``deepspeed.elasticity``: elastic batch sizes (pure arithmetic, in ds-config); submodules are compat rows."""

from ds_config.elastic import compute_elastic_config, elasticity_enabled, ensure_immutable_elastic_config
from ds_config.elastic_constants import ELASTICITY, ENABLED, ENABLED_DEFAULT
from ds_config.elasticity import (
    ElasticityConfig,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
)

__all__ = ["compute_elastic_config", "elasticity_enabled", "ensure_immutable_elastic_config", "ElasticityConfig",
           "ElasticityError", "ElasticityConfigError", "ElasticityIncompatibleWorldSize", "ELASTICITY", "ENABLED",
           "ENABLED_DEFAULT"]
