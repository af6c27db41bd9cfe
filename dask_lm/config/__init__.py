"""The one home of dask-lm's configuration: the Policy config (NeMo RL's ``policy:`` section, typed), its checks
and the defaults several modules share.

- :mod:`.schema`: reading a section from a plain dict (type checks, dotted-key errors) and writing it back;
- :mod:`.policy`: :class:`PolicyConfig` and its sections; :mod:`.generation`: ``policy.generation`` and its
  ``sglang_cfg``;
- :mod:`.keys`: the NeMo RL keys accepted but not acted on, and the check that refuses or warns about them;
- :mod:`.optim`: the optimizer and scheduler sections resolved against torch (imports torch, so not imported here);
- :mod:`.defaults`: the micro-batch token budgets;
- :mod:`.doc`: the generator of the config reference table (``python -m dask_lm.config.doc``).

The dependency order is ``schema -> generation -> keys -> policy``, one way: no module here imports one that
imports it."""

from dask_lm.config.generation import GenerationConfig, SGLangConfig
from dask_lm.config.policy import (DTensorConfig, DynamicBatchingConfig, MegatronConfig, OptimizerConfig,
                                   PolicyConfig, RewardModelConfig, SequencePackingConfig, TokenizerConfig)
from dask_lm.config.schema import config_from_dict

__all__ = ["PolicyConfig", "TokenizerConfig", "DTensorConfig", "MegatronConfig", "DynamicBatchingConfig",
           "SequencePackingConfig", "GenerationConfig", "SGLangConfig", "RewardModelConfig", "OptimizerConfig",
           "config_from_dict"]
