"""Old import path of the refit receiver (``receive_via_zmq``, ``CollectiveReceiver``), which users' inference
processes may still import; importing it warns. The receiver is :mod:`dask_lm.refit.receiver`."""

from dask_lm.moved import moved_module
from dask_lm.refit.receiver import CollectiveReceiver, receive_via_zmq

__all__ = ["receive_via_zmq", "CollectiveReceiver"]

moved_module(__name__, "dask_lm.refit.receiver")
