"""``deepspeed.elasticity``: elastic batch sizes (pure arithmetic, in ds-config); submodules are compat rows."""

from deepspeed.compat import submodule_getattr
from ds_config.elastic import compute_elastic_config, elasticity_enabled, ensure_immutable_elastic_config
from ds_config.elastic_constants import ELASTICITY, ENABLED, ENABLED_DEFAULT
from ds_config.elasticity import (
    ElasticityConfig,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
)

__getattr__ = submodule_getattr(__name__)  # deepspeed.elasticity.config/.elasticity/.constants as attributes

__all__ = ["compute_elastic_config", "elasticity_enabled", "ensure_immutable_elastic_config", "ElasticityConfig",
           "ElasticityError", "ElasticityConfigError", "ElasticityIncompatibleWorldSize", "ELASTICITY", "ENABLED",
           "ENABLED_DEFAULT"]
