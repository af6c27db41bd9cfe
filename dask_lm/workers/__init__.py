"""Worker side of dask-lm: code that runs inside the Dask worker processes, one process per GPU."""
