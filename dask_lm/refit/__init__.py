"""Refit, both halves: the driver's calls (``driver``), the training rank's sender (``rank``, ``http``), the
transports (``buckets``, ``wire``, ``zmq_endpoint``) and the inference side's receiver (``receiver``)."""
