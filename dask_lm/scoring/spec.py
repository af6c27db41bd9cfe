"""``ScoreSpec``: what a scoring job (``score_parquet``, ``dask-lm score``) computes, each option declared once
(:mod:`dask_lm.jobs.spec` says what derives from it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dask_lm.config.defaults import PACKED_BATCH_TOKENS, PADDED_BATCH_TOKENS
from dask_lm.data.continuation import Convention, check_convention
from dask_lm.interface import opt
from dask_lm.jobs.spec import JobSpec, check_columns, option, precision_name

if TYPE_CHECKING:  # the messages module imports distributed: the command line does not pay for it
    from dask_lm.data.messages import ScoreOptions

__all__ = ["ScoreSpec", "check_score_options", "ROW_COLUMNS", "row_columns"]

# the options that name the input columns a row is scored from
ROW_COLUMNS = ("text_column", "ids_column", "prompt_column", "response_column", "prompt_length_column")


@dataclass(frozen=True, kw_only=True)
class ScoreSpec(JobSpec):
    """One scoring job's inputs, model and options (not where it runs: the client, the output folder and what to do
    with one that holds a job are the call's)."""

    JOB = "scoring job"
    MODE_COLUMNS = ("text_column", "ids_column", "prompt_column", "response_column")

    input: tuple[str, ...] = option(role="source", cli=False, help="Parquet files, directories or globs.")
    model: str = option(
        role="source",
        help="Hugging Face Hub id (e.g. Qwen/Qwen2.5-0.5B; downloaded once into the "
        "Hugging Face cache, HF_HUB_OFFLINE=1: the cache only) or model directory. Required, as "
        "INPUTS are, except with --resume.",
    )
    text_column: str | None = option(
        None, help="Score this string column (every token, the first one given BOS / EOS)."
    )
    ids_column: str | None = option(None, help="Score this list<int> column of token ids as it is.")
    prompt_length_column: str | None = option(
        None,
        help="With --ids-column: this integer column says how many leading ids of each row are context (not scored).",
    )
    prompt_column: str | None = option(None, help="With --response-column: score only the response tokens.")
    response_column: str | None = option(None, help="With --prompt-column: the string column whose tokens are scored.")
    convention: str = option(
        "lm-eval",
        choices=("lm-eval", "separate"),
        help="How text is tokenized. lm-eval: as "
        "lm-evaluation-harness does (the response encoded in context, trailing prompt whitespace "
        "moved to it, one BOS at most, an empty prompt or a text conditioned on BOS/EOS). "
        "separate: prompt and response encoded apart, a text's first token unscored (as dask-lm "
        "logprobs does).",
    )
    id_column: str | None = option(None, help="Keep only this input column in the output (default: all).")
    topk: int = option(0, help="Also write the k most likely tokens.")
    decode_topk: bool = option(
        False, help="With --topk: also write their strings (topk_tokens, each id as the tokenizer decodes it alone)."
    )
    max_length: int | None = option(
        None,
        help="Longest row in tokens (default and upper bound: the model's "
        "max_position_embeddings); longer rows are bad rows.",
    )
    truncate: bool = option(
        False,
        help="Keep the last --max-length tokens of a longer row (cuts the context side; a "
        "response is kept whole) instead of failing on it; such rows have truncated=true.",
    )
    allow_nonfinite: bool = option(
        False, role="setting", help="Keep NaN/inf logprobs instead of failing the job on them."
    )
    batch_tokens: int | None = option(
        None,
        role="setting",
        help="Tokens per micro-batch: real tokens where GPU "
        f"workers pack rows (default {PACKED_BATCH_TOKENS}), padded ones elsewhere "
        f"(default {PADDED_BATCH_TOKENS}).",
    )
    task_tokens: int | None = option(
        None,
        role="setting",
        help="Tokens per task and part file, estimated from the "
        "footers (default: about 1/32 of the job, 16k to 1M): large row groups are "
        "split, small ones merged; 0: one task per row group, as written.",
    )
    compile: bool | None = option(
        None,
        role="setting",
        toggle=True,
        help="Compile the forward on GPU workers "
        "(torch.compile): faster scoring after a one-time compilation of 5-10 s per worker "
        "process. Default: only for jobs of about 8M tokens or more per worker.",
    )
    precision: str = option(
        "auto", choices=("auto", "bf16", "fp32", "fp16"), help="auto: bf16 on GPU workers, fp32 on CPU ones."
    )
    tokenizer: str | None = option(None, role="source", help="Tokenizer directory or Hub id (default: the model's).")
    skip_bad_rows: bool = option(False, help="Leave bad rows out (listed in _errors.parquet) instead of failing.")

    def check(self) -> None:
        convention = check_score_options(self, task_tokens=self.task_tokens or 0)
        object.__setattr__(self, "convention", convention)
        # the torch dtype's name, or auto: the workers' devices decide once the cluster is up
        object.__setattr__(self, "precision", precision_name(self.precision) or "auto")

    @property
    def fixed_precision(self) -> str | None:
        """The torch dtype's name, or ``None`` where the workers' devices decide (``auto``)."""
        return None if self.precision == "auto" else self.precision

    def columns(self) -> dict[str, str | None]:
        """The input columns the job reads, by option name (the keywords of
        :func:`dask_lm.io.parquet.inspect_inputs`)."""
        return {name: getattr(self, name) for name in (*ROW_COLUMNS, "id_column")}

    @property
    def mode(self) -> str:
        """How the rows are read: ``"ids"``, ``"text"`` or ``"pair"`` (prompt + response)."""
        return "ids" if self.ids_column else "text" if self.text_column else "pair"

    def manifest_options(self) -> dict[str, Any]:
        options = super().manifest_options()
        if not self.decode_topk:  # pinned once set: a manifest written before the option resumes as it was written
            del options["decode_topk"]
        options["precision"] = self.fixed_precision  # an automatic one is pinned once the workers are known
        return options


def check_score_options(options: ScoreSpec | ScoreOptions, *, task_tokens: int | None = None) -> Convention:
    """The scoring options' own checks, shared by ``score_parquet`` and ``dask_lm.score``: one way to read the
    rows, the convention, the numbers' ranges (``task_tokens``: the file job's, checked where given). Returns the
    convention."""
    o = options
    check_columns(
        text_column=o.text_column,
        ids_column=o.ids_column,
        prompt_column=o.prompt_column,
        response_column=o.response_column,
    )
    conv = check_convention(o.convention, opt("convention"))
    if o.prompt_length_column is not None and o.ids_column is None:
        raise ValueError(
            f"{opt('prompt_length_column')} goes with {opt('ids_column')} (prompt + response text has "
            f"its prompt length from {opt('prompt_column')})"
        )
    if o.topk < 0 or (task_tokens or 0) < 0 or any(v is not None and v < 1 for v in (o.max_length, o.batch_tokens)):
        counts = (
            f"{opt('topk')} and {opt('task_tokens')} must be" if task_tokens is not None else f"{opt('topk')} must be"
        )
        raise ValueError(f"{counts} >= 0, {opt('max_length')} and {opt('batch_tokens')} >= 1")
    if o.decode_topk and not o.topk:
        raise ValueError(
            f"{opt('decode_topk', True)} decodes the top-k ids: it needs {opt('topk', meta='K')} (e.g. "
            f"{opt('topk', 5)})"
        )
    return conv


def row_columns(options: ScoreSpec | ScoreOptions) -> list[str]:
    """The input columns the rows are scored from, sorted, each once."""
    return sorted({name for name in (getattr(options, key) for key in ROW_COLUMNS) if name})
