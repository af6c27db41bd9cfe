"""What every batch job over parquet shares: ``score`` (:mod:`dask_lm.scoring.job`), ``sft`` (:mod:`dask_lm.sft.job`)
and the jobs to come.

A job declares its options once, in its spec (``spec.py``: :class:`~dask_lm.jobs.spec.JobSpec`, a frozen typed
dataclass per job), from which its function's checks, the CLI's options, the manifest and the reference docs
derive. Every job's driver then goes through the same steps, and this package owns each of them; a job's own package
keeps its spec, the work itself and its summary:

1. :meth:`JobOutput.open <dask_lm.jobs.output.JobOutput.open>` (``output.py``): the input files resolved, an output
   nested with them refused, the output's lock taken (``folder.py``: a second job on it is refused here, before
   anything starts; held until ``JobOutput.close``, and a job that wrote nothing removes what taking it created),
   and a first look at the output folder: an occupied one without ``--resume`` / ``--overwrite`` is refused
   before the model is even resolved. On ``--resume`` what the call was
   not given comes from the manifest (``resume.py``: :func:`~dask_lm.jobs.resume.spec_for`).
2. ``model_files.py``: the model files resolved and checked, the tokenizer's, and the manifest that pins them, the
   inputs (by content: :mod:`dask_lm.io.fingerprint`) and the options (its format and seal:
   :mod:`dask_lm.io.manifest`).
3. ``JobOutput.locked``: the output's lock until the job ends. Under it the folder is looked at again,
   ``--overwrite`` clears the earlier job, a killed job's temporaries are deleted, ``JobOutput.pin`` writes the
   manifest or checks a resumed job against it (the differences named: ``resume.py``), and
   ``JobOutput.pin_precision`` records an automatic precision once the workers are known.
4. ``start.py``: the cluster started beside the driver's checks, then the Dask client (the caller's, or one
   connected here and closed at the end, with the local cluster it started) and the job's progress bar, with the
   dashboard's address above it.
5. ``model_files.located_partitions``: one read task per row group, whose failure names file and row group; the
   rows are tokenized on the workers by :func:`dask_lm.data.rows.tokenize_rows`, the one tokenization of every job.
6. ``model_files.publishing`` for a directory that must appear whole (:func:`dask_lm.io.checkpoint.publish`:
   fsync'd, then renamed), and ``JobOutput.finish``, which writes ``_SUCCESS`` last, once every pinned file is
   confirmed unchanged since the job hashed it (a file changed mid-job fails it instead, exit 1).

Ctrl-C and SIGTERM stop a job with one line and the conventional exit code (``interrupts.py``).
"""
