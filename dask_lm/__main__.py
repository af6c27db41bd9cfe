"""``python -m dask_lm`` is the ``dask-lm`` command."""

from dask_lm.cli import main

main()
