"""Stateless model compute shared by the Policy ranks, the scoring replicas and lm-eval: the forward pass, packed
(varlen) attention, log-probabilities and their fused heads, loss inputs, the device, HF introspection and model
load. Nothing here holds a worker's state; importing the package itself imports no torch (``hf`` is also read by
the driver's checks)."""
