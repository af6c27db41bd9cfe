"""The inference forward's compile, paid in the background while the rank already answers calls.

A fresh process compiles its decoder layers on its first compiled forward: Dynamo traces a layer again in every
process (its bytecode and guards are not cached on disk), and Inductor loads the kernels from its on-disk caches.
On an H100 that made a fresh Policy's first ``get_logprobs`` of 2048 rows at 0.5B take 4.9 s against 0.63 s warm,
with every cache hit. So a rank without peers starts that compile as soon as its model is built, in a thread of its
own, on a few synthetic rows through the same forward and output head a call uses (packed rows, padded rows, one
padded row: the layouts a call's micro-batches take, each its own graph). Until it is done, calls run their
micro-batches eagerly (the same arithmetic, slower); from the next micro-batch after it, compiled.

Only ranks without peers compile ahead: an FSDP rank's forward all-gathers its parameters, and a forward of its own
beside the call's would interleave collectives with the other ranks. The compile is the same one the first call
would have made (same layers, same options, dynamic shapes): its graphs serve every later size without another
trace, which ``tests/test_compile_ahead.py`` counts.

The thread only reads the model. Whatever moves or drops the weights (offloading to the host, the Policy's
shutdown) first waits for it (:meth:`CompileAhead.wait`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from dask_lm.data.tokens import TokenRows
from dask_lm.model import device, fused
from dask_lm.model.forward import MicroBatch

if TYPE_CHECKING:
    from dask_lm.workers.rank_model import RankModel

__all__ = ["CompileAhead"]

logger = logging.getLogger(__name__)

# the synthetic micro-batches, each a graph of its own: packed rows, padded rows, and one padded row (a batch of
# one is a graph of its own: Dynamo specialises sizes 0 and 1, and an unpadded row needs no attention mask). Lengths
# unlike each other and unlike 0 / 1: two equal sizes would become a guard that later calls fail and retrace on
_MICRO_BATCHES = (((37, 23, 11), True), ((29, 17, 13), False), ((19,), False))


class CompileAhead:
    """The compile of one rank's inference forward, running in a daemon thread (:meth:`start`)."""

    def __init__(self, model: RankModel) -> None:
        self._model = model
        self._done = threading.Event()
        self.seconds: float | None = None
        """How long the compile took (None until done)."""
        self.failed: BaseException | None = None
        """What stopped it, if anything: a compile error turns compiling off for the rank."""
        self._thread = threading.Thread(target=self._run, name="dask-lm-compile-ahead", daemon=True)

    @classmethod
    def start(cls, model: RankModel) -> CompileAhead:
        ahead = cls(model)
        ahead._thread.start()
        return ahead

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the compile has finished (or failed); whether it has."""
        return self._done.wait(timeout)

    def _rows(self, lengths: tuple[int, ...]) -> TokenRows:
        hf: Any = self._model.model  # a transformers PreTrainedModel (Module's __getattr__ types it Tensor | Module)
        vocab = int(hf.get_input_embeddings().num_embeddings)
        return TokenRows.from_lists(
            [[3 + (7 * i + 5 * j) % (vocab - 3) for j in range(n)] for i, n in enumerate(lengths)]
        )

    def _run(self) -> None:
        start = time.perf_counter()
        model = self._model
        try:
            with torch.no_grad(), fused.use_compiled(True):
                for lengths, packed in _MICRO_BATCHES:
                    rows = self._rows(lengths)
                    hidden, layout = model.forward_micro_batch(rows, MicroBatch(0, rows.size, packed=packed))
                    assert layout is not None
                    model.logprob_head(hidden, layout)
            device.synchronize()
        except fused.compile_errors() as e:
            self.failed = e
            logger.warning(
                "compiling this rank's decoder failed (%s: %s); it runs eagerly from now on", type(e).__name__, e
            )
        except Exception as e:  # the call's own compile (on its first micro-batch) reports it then
            self.failed = e
            logger.debug("compiling ahead stopped (%s: %s); the first call compiles instead", type(e).__name__, e)
        finally:
            self.seconds = time.perf_counter() - start
            self._done.set()
