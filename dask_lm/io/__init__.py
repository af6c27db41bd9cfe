"""Data in and out of dask-lm: parquet inputs and outputs, checkpoints, model files, fingerprints.

Import the module you need (``from dask_lm.io import hub``). Nothing is re-exported here, so importing one of them
loads only what it needs: a job's driver (``dask-lm score``: checks, fingerprints, the manifest) never imports
torch. The Arrow conversion of batches lives in :mod:`dask_lm.data.arrow`."""
