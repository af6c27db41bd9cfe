"""The old home of the refit receiver, kept because users' inference processes import it by this path (releases
before the ``dask_lm.refit`` package documented ``dask_lm.refit_receiver.receive_via_zmq`` and
``CollectiveReceiver``). New code imports :mod:`dask_lm.refit.receiver`."""

from dask_lm.refit.receiver import CollectiveReceiver, receive_via_zmq

__all__ = ["receive_via_zmq", "CollectiveReceiver"]
