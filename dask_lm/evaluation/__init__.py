"""lm-eval, both halves, in one room (one home per subsystem): the token-id requests behind the
lm-evaluation-harness model class (:mod:`dask_lm.harness`, which stays at its public path).

The driver half: the request engine (``engine.py``: ``RequestEngine``), which sorts and cuts the requests into
tasks and gathers their results in request order; it never initialises CUDA. The rank half (``requests.py``):
a task's rows scored, or generated after, on the worker's scoring replica (:mod:`dask_lm.scoring.replicas`).
``tasks.py`` holds the functions the driver submits.

Evaluation sits above scoring (it shares scoring's replicas and forward) and above the shared packages; nothing
below imports it (``tests/test_import_graph.py``).
"""
