"""One rank of a Policy: the rank's model and the components that hold the rest of its state, composed.

A ``PolicyWorker`` lives inside a Dask worker process (held by the plugin in ``state.py``) and is driven by
pinned tasks from ``tasks.py``, through the endpoint table (:mod:`dask_lm.workers.endpoints`). It builds, in order:

- :class:`~dask_lm.workers.rank_model.RankModel`: the model (built, sharded, loaded; the reference and master
  weights) and the passes over it: logprobs, top-k, scores, the forward protocol the others use;
- :class:`~dask_lm.workers.trainer.Trainer`: optimizer, LR scheduler; runs ``train``;
- :class:`~dask_lm.workers.checkpointing.Checkpointer`: the background writer and the pending async save;
- :class:`~dask_lm.refit.rank.Refitter`: the refit gloo groups, the collective group, the ZMQ socket;
- :class:`~dask_lm.workers.full_logits.FullLogitsExport`: the shareable buffer of ``get_full_logits_ipc``.

Each component is given the model (and the trainer, for checkpoints) when it is made, and the endpoints call it
directly: a call does not pass through the worker, and no component is handed the worker back. What is left here
is what spans components: moving the weights and the optimizer state between the device and host memory around
training, inference and refits, and shutting everything down in order. Those argument-free calls (and the few
others in :data:`~dask_lm.workers.endpoints.EXTENSION_BASE_METHODS`) are methods of the worker because a user's
worker extension class (``run_all_workers_*``) subclasses it and may call or override them by name.
"""

from __future__ import annotations

from typing import Any

import torch

from dask_lm.config import PolicyConfig
from dask_lm.model import device
from dask_lm.model.weights import local_tensor
from dask_lm.refit.rank import Refitter
from dask_lm.workers.checkpointing import Checkpointer
from dask_lm.workers.full_logits import FullLogitsExport
from dask_lm.workers.rank_model import RankModel, RankPlace
from dask_lm.workers.trainer import Trainer

# local_tensor is re-exported: worker extension classes import it from here (its home is dask_lm.model.weights)
__all__ = ["PolicyWorker", "local_tensor"]


class PolicyWorker:
    """The model of one rank and the components that hold the rest of its state."""

    def __init__(
        self,
        cfg: PolicyConfig,
        place: RankPlace,
        *,
        pad_token_id: int,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        skip_weight_load: bool = False,
        fsdp: bool | None = None,
    ) -> None:
        self.rank_model = RankModel(
            cfg,
            place,
            pad_token_id=pad_token_id,
            trainable=bool(init_optimizer and cfg.optimizer is not None),
            keep_reference=init_reference_model,
            weights_path=weights_path,
            skip_weight_load=skip_weight_load,
            fsdp=fsdp,
        )
        # built after the weights are restored: an optimizer class may read the weights it is given (a user's, by
        # import path)
        self.trainer = Trainer(self.rank_model, trainable=self.rank_model.trainable)
        self.checkpointer = Checkpointer(self.rank_model, self.trainer)
        if optimizer_path:
            self.checkpointer.load_optimizer(optimizer_path)
        self.refitter = Refitter(self.rank_model)
        self.full_logits = FullLogitsExport(self.rank_model)
        self.extension_state: dict[str, Any] = {}

    # what a worker extension class reads of its rank (``self.model``, ``self.rank``, ...), as attributes of the
    # worker it extends
    @property
    def cfg(self) -> PolicyConfig:
        return self.rank_model.cfg

    @property
    def rank(self) -> int:
        return self.rank_model.rank

    @property
    def world_size(self) -> int:
        return self.rank_model.world_size

    @property
    def model(self) -> torch.nn.Module:
        return self.rank_model.model

    @property
    def device(self) -> torch.device:
        return self.rank_model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.rank_model.dtype

    # ----------------------------------------------------------------------------------------- placement
    def prepare_for_training(self) -> bool:
        self.rank_model.ensure_on_device()
        if self.trainer.optimizer is not None:
            self.trainer.move_to(self.rank_model.device)
        return True

    def finish_training(self) -> bool:
        return True

    def prepare_for_lp_inference(self) -> bool:
        self.rank_model.ensure_on_device()
        self.rank_model.model.eval()
        if self.rank_model.cfg.offload_optimizer_for_logprob:
            self.trainer.move_to("cpu")
        device.empty_cache()
        return True

    def prepare_for_generation(self) -> bool:
        self.rank_model.ensure_on_device()
        self.rank_model.model.eval()
        return True

    def finish_generation(self) -> bool:
        return True

    def invalidate_kv_cache(self) -> bool:
        return True  # generation keeps no KV cache between calls

    def finish_inference(self) -> bool:
        return self._to_host(weights=True, optimizer=False)

    def offload_before_refit(self) -> bool:
        """Optimizer state (and fp32 masters) to host memory: the weights stay, ready to be streamed."""
        return self._to_host(weights=False, optimizer=True)

    def offload_to_cpu(self) -> bool:
        """Everything to host memory: weights, optimizer state, masters."""
        self.rank_model.model.eval()
        return self._to_host(weights=True, optimizer=True)

    def _to_host(self, *, weights: bool, optimizer: bool) -> bool:
        """The weights and / or the optimizer's state (with the fp32 masters) to host memory, then the device's
        cached blocks released."""
        if weights:
            self.rank_model.to_host()
        if optimizer:
            self.trainer.move_to("cpu")
        device.empty_cache()
        return True

    offload_after_refit = offload_to_cpu

    # ----------------------------------------------------------------------------------------- extension calls
    # The endpoints answer these argument-free calls through the worker (not the component), so that a worker
    # extension class that overrides one by name is what the driver's call reaches, as ever.
    def prepare_refit_info(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        return self.refitter.info()

    def report_device_id(self) -> str:
        return device.device_id()

    def finalize_async_save(self) -> bool:
        return self.checkpointer.finalize()

    def release_ipc_buffer(self) -> bool:
        return self.full_logits.release()

    def shutdown(self, orphaned: bool = False) -> None:
        """Free everything. ``orphaned``: the driver or a peer rank is gone, so nothing here may wait on a
        collective (a pending async save is abandoned instead of finished)."""
        self.checkpointer.close(orphaned=orphaned)
        self.full_logits.release()
        self.refitter.close()
        self.trainer.close()
        self.rank_model.close()
