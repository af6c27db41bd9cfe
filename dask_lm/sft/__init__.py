"""Scheduled fine-tuning over parquet, ``dask-lm sft``: the job (``job.py``: ``sft_parquet``, ``SFTResult``), built
on the batch jobs' shared steps (:mod:`dask_lm.jobs`) and trained through the Policy (:mod:`dask_lm.engine`)."""
