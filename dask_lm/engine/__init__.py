"""Driver side of dask-lm: owns no model and never initialises CUDA."""
