"""The one home of dask-lm's configuration: the Policy config (NeMo RL's ``policy:`` section, typed), its checks
and the defaults several modules share.

- :mod:`.schema`: reading a section from a plain dict (type checks, dotted-key errors) and writing it back;
- :mod:`.policy`: :class:`PolicyConfig` and its sections; :mod:`.generation`: ``policy.generation`` and its
  ``sglang_cfg``;
- :mod:`.keys`: what dask-lm does with each NeMo RL key it does not act on as NeMo RL does, and the check that
  refuses or warns about them; :mod:`.equivalents`: the torch optimizer that runs for Transformer Engine's
  ``FusedAdam``;
- :mod:`.optim`: the optimizer and scheduler sections resolved against torch (imports torch, so not imported here);
- :mod:`.defaults`: the micro-batch token budgets;
- :mod:`.doc`: the generator of the config reference table (``python -m dask_lm.config.doc``); :mod:`.nemo_table`:
  the NeMo RL key table (``python -m dask_lm.config.nemo_table``).

The dependency order is ``schema -> generation -> equivalents -> keys -> policy``, one way: no module here imports
one that imports it."""

from dask_lm.config import policy
from dask_lm.config.generation import GenerationConfig, SGLangConfig
from dask_lm.config.policy import *  # noqa: F403  # the Policy config's names: policy.__all__, written there only
from dask_lm.config.schema import config_from_dict

__all__ = ["GenerationConfig", "SGLangConfig", "config_from_dict"]
__all__ += policy.__all__
