"""Scoring, both halves, in one room (one home per subsystem): ``score_parquet`` and ``dask_lm.score``.

The driver half: the file job (``job.py``: ``score_parquet``; its summary ``ScoreResult``: ``result.py``), its typed
spec (``spec.py``: ``ScoreSpec``, whose options check themselves), the Dask DataFrame in / out (``frame.py``:
``dask_lm.score``), the warm-up its cluster start submits (``preload.py``), the driver's pre-scan of the rows
(``prescan.py``), the rows cut into tasks by tokens (``spans.py``), the model's checks (``checks.py``), when
compiling pays (``compile_choice.py``) and the start's clock (``start_clock.py``). It never initialises CUDA. The
rank half, run inside the Dask workers: the one scoring path (``scorer.py``), a Dask DataFrame's partition scored
(``partitions.py``) and the model replica each worker keeps (``replicas.py``). ``tasks.py`` holds the functions the
driver submits; they import the rank half on the worker.

Scoring sits above the shared packages (``dask_lm.jobs``, the batch jobs' scaffold, ``dask_lm.engine``'s cluster,
``dask_lm.workers``' plugin state, ``dask_lm.model``): they never import it (``tests/test_import_graph.py``).
"""
