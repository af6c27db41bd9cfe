"""``SFTSpec``: what a fine-tuning run (``sft_parquet``, ``dask-lm sft``) trains on and how, each option declared
once (:mod:`dask_lm.jobs.spec` says what derives from it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dask_lm.data.continuation import check_convention
from dask_lm.interface import opt
from dask_lm.jobs.spec import JobSpec, check_columns, option, precision_name

__all__ = ["SFTSpec"]


@dataclass(frozen=True, kw_only=True)
class SFTSpec(JobSpec):
    """One fine-tuning run's inputs, model and options (not where it runs: the client and the output folder are
    the call's). ``max_steps``, ``micro_batch_size``, ``save_every`` and ``keep`` change no trained value: a resume
    may give new ones (a larger ``max_steps`` trains on)."""

    JOB = "sft run"
    MODE_COLUMNS = ("text_column", "prompt_column", "response_column")

    input: tuple[str, ...] = option(role="source", cli=False, help="Parquet files, directories or globs.")
    model: str = option(
        role="source",
        help="Hugging Face Hub id or model directory to start from. Required, as INPUTS are, except with --resume.",
    )
    text_column: str | None = option(None, help="Train on every token of this string column.")
    prompt_column: str | None = option(None, help="With --response-column: train on the response tokens only.")
    response_column: str | None = option(None, help="With --prompt-column: the string column trained on.")
    convention: str = option(
        "lm-eval", choices=("lm-eval", "separate"), help="How text is tokenized, as in dask-lm score --convention."
    )
    epochs: int = option(1, help="Passes over the rows.")
    max_steps: int | None = option(
        None, role="setting", help="Stop after this many optimizer steps (default: all the epochs' steps)."
    )
    global_batch_size: int = option(32, help="Rows per optimizer step.")
    micro_batch_size: int = option(
        4, role="setting", help="Rows per forward/backward pass on a worker (token budget: --max-length times this)."
    )
    lr: float = option(1e-5, help="AdamW learning rate.")
    weight_decay: float = option(0.01, help="AdamW weight decay.")
    warmup_steps: int = option(0, help="Linear learning-rate warm-up steps.")
    max_length: int = option(1024, help="Longest row in tokens.")
    truncate: bool = option(False, help="Cut rows over --max-length instead of failing on them.")
    precision: str = option(
        "auto",
        choices=("auto", "bf16", "fp32"),
        help="auto: bf16 (fp32 master weights) on GPU workers, fp32 on CPU ones.",
    )
    save_every: int = option(100, role="setting", help="Checkpoint every N steps (and at the end).")
    keep: int = option(2, role="setting", help="Newest checkpoints to keep.")
    seed: int = option(0, help="Seed of the per-epoch row order.")
    shuffle: bool = option(True, flag="--no-shuffle", help="Walk the rows in input order.")

    def check(self) -> None:
        check_columns(
            text_column=self.text_column,
            prompt_column=self.prompt_column,
            response_column=self.response_column,
            takes_ids=False,
        )
        object.__setattr__(self, "convention", check_convention(self.convention, opt("convention")))
        for key in ("epochs", "global_batch_size", "micro_batch_size", "max_length", "save_every", "keep"):
            if getattr(self, key) < 1:
                raise ValueError(f"{opt(key)} must be >= 1, got {getattr(self, key)}")
        object.__setattr__(self, "precision", precision_name(self.precision, allowed=("bf16", "fp32")) or "auto")

    @property
    def fixed_precision(self) -> str | None:
        """The torch dtype's name, or ``None`` where the workers' devices decide (``auto``)."""
        return None if self.precision == "auto" else self.precision

    def manifest_options(self) -> dict[str, Any]:
        options = super().manifest_options()
        options["precision"] = self.fixed_precision  # an automatic one is pinned once the workers are known
        return options
