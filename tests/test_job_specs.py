"""The batch jobs' typed specs (dask_lm.jobs.spec) and resume, without a cluster: a spec made from a call and from
a manifest, the manifest's options and settings, the difference check naming what differs, and the commands'
options derived from the specs. Every test here runs in well under a second."""

from __future__ import annotations

import dataclasses
import inspect
import os

import pytest

from dask_lm import interface
from dask_lm.jobs import resume
from dask_lm.jobs.spec import options_of
from dask_lm.scoring.spec import ScoreSpec
from dask_lm.sft.spec import SFTSpec

SCORE_PINNED = {
    "text_column",
    "ids_column",
    "prompt_length_column",
    "prompt_column",
    "response_column",
    "id_column",
    "convention",
    "topk",
    "decode_topk",
    "max_length",
    "truncate",
    "precision",
    "skip_bad_rows",
}
SCORE_SETTINGS = {"allow_nonfinite", "batch_tokens", "task_tokens", "compile"}
SFT_PINNED = {
    "text_column",
    "prompt_column",
    "response_column",
    "convention",
    "epochs",
    "global_batch_size",
    "lr",
    "weight_decay",
    "warmup_steps",
    "max_length",
    "truncate",
    "precision",
    "seed",
    "shuffle",
}
SFT_SETTINGS = {"max_steps", "micro_batch_size", "save_every", "keep"}


def _manifest(spec, model="/m"):
    """A manifest as a job writes one: its sources by path (content hashes left out) and the spec's options."""
    return {
        "format": 1,
        "model": model,
        "inputs": [{"path": p, "size": 1, "sha256": "0" * 64} for p in spec.input],
        "options": spec.manifest_options(),
        "settings": spec.manifest_settings(),
    }


def test_a_call_gets_the_documented_defaults():
    spec = ScoreSpec.build({"input": "a.parquet", "model": "/m", "text_column": "text", "topk": None})
    assert spec.input == ("a.parquet",) and spec.model == "/m"
    assert (
        spec.convention,
        spec.topk,
        spec.decode_topk,
        spec.truncate,
        spec.skip_bad_rows,
        spec.precision,
        spec.compile,
    ) == ("lm-eval", 0, False, False, False, "auto", None)
    sft = SFTSpec.build({"input": ["a.parquet"], "model": "/m", "prompt_column": "p", "response_column": "r"})
    assert (
        sft.epochs,
        sft.global_batch_size,
        sft.micro_batch_size,
        sft.lr,
        sft.weight_decay,
        sft.warmup_steps,
        sft.max_length,
        sft.save_every,
        sft.keep,
        sft.seed,
        sft.shuffle,
        sft.convention,
    ) == (1, 32, 4, 1e-5, 0.01, 0, 1024, 100, 2, 0, True, "lm-eval")


def test_the_manifest_pins_the_options_and_records_the_settings():
    spec = ScoreSpec.build(
        {
            "input": ("a.parquet",),
            "model": "/m",
            "ids_column": "ids",
            "decode_topk": None,
            "precision": "bf16",
            "task_tokens": 0,
        }
    )
    assert set(spec.manifest_options()) == SCORE_PINNED - {"decode_topk"}  # written only once set
    assert spec.manifest_options()["precision"] == "bfloat16"
    assert set(spec.manifest_settings()) == SCORE_SETTINGS
    assert (
        set(
            ScoreSpec.build(
                {"input": "a", "model": "/m", "text_column": "t", "topk": 2, "decode_topk": True}
            ).manifest_options()
        )
        == SCORE_PINNED
    )
    sft = SFTSpec.build({"input": "a", "model": "/m", "text_column": "t"})
    assert set(sft.manifest_options()) == SFT_PINNED and set(sft.manifest_settings()) == SFT_SETTINGS
    assert sft.manifest_options()["precision"] is None  # auto: pinned once the workers are known


@pytest.mark.parametrize(
    "spec",
    [
        ScoreSpec(
            input=("a.parquet", "b.parquet"),
            model="/m",
            prompt_column="p",
            response_column="r",
            topk=3,
            decode_topk=True,
            max_length=64,
            truncate=True,
            precision="fp32",
            skip_bad_rows=True,
            task_tokens=0,
            batch_tokens=512,
            compile=False,
            allow_nonfinite=True,
            convention="separate",
            id_column="id",
        ),
        ScoreSpec(input=("a.parquet",), model="/m", ids_column="ids", prompt_length_column="n"),
        SFTSpec(
            input=("a.parquet",),
            model="/m",
            text_column="t",
            epochs=3,
            max_steps=7,
            global_batch_size=8,
            micro_batch_size=2,
            lr=0.5,
            weight_decay=0.0,
            warmup_steps=2,
            max_length=77,
            truncate=True,
            precision="bf16",
            save_every=3,
            keep=1,
            seed=9,
            shuffle=False,
            convention="separate",
        ),
    ],
    ids=["score-pair", "score-ids", "sft"],
)
def test_a_resume_given_nothing_rebuilds_the_spec_from_the_manifest(spec):
    assert type(spec).build({}, manifest=_manifest(spec)) == spec


def test_a_manifest_with_an_automatic_precision_resumes_automatic():
    spec = ScoreSpec(input=("a",), model="/m", text_column="t")
    assert ScoreSpec.build({}, manifest=_manifest(spec)).precision == "auto"


def test_a_given_option_wins_over_the_manifest_and_the_difference_is_named(tmp_path):
    old = ScoreSpec(input=("a",), model="/m", text_column="t", topk=2)
    resumed = ScoreSpec.build({"topk": 5}, manifest=_manifest(old))
    assert resumed.topk == 5 and resumed.text_column == "t"
    with interface.cli(), pytest.raises(ValueError, match=r"--topk") as e:
        resume.check_resume(_manifest(old), _manifest(resumed), output=str(tmp_path), what="scored")
    assert "2" in str(e.value) and "5" in str(e.value)


def test_a_given_setting_replaces_the_recorded_one_without_a_difference(tmp_path):
    old = SFTSpec(input=("a",), model="/m", text_column="t", max_steps=4, keep=3)
    resumed = SFTSpec.build({"max_steps": 10}, manifest=_manifest(old))
    assert (resumed.max_steps, resumed.keep) == (10, 3)
    resume.check_resume(_manifest(old), _manifest(resumed), output=str(tmp_path), what="trained")  # no error


def test_one_way_to_read_the_rows_is_taken_whole_from_the_call(tmp_path):
    """A job read by ids, resumed naming a text column: the text column is not joined to the manifest's ids column
    (that would be refused as two ways at once); the difference check names both options."""
    old = ScoreSpec(input=("a",), model="/m", ids_column="ids")
    resumed = ScoreSpec.build({"text_column": "text"}, manifest=_manifest(old))
    assert (resumed.text_column, resumed.ids_column) == ("text", None)
    with interface.cli(), pytest.raises(ValueError) as e:
        resume.check_resume(_manifest(old), _manifest(resumed), output=str(tmp_path), what="scored")
    assert "--ids-column" in str(e.value) and "--text-column" in str(e.value)


def test_the_shuffle_flag_is_named_as_the_command_spells_it(tmp_path):
    old = SFTSpec(input=("a",), model="/m", text_column="t")
    resumed = SFTSpec.build({"shuffle": False}, manifest=_manifest(old))
    with interface.cli(), pytest.raises(ValueError, match="--no-shuffle"):
        resume.check_resume(
            _manifest(old), _manifest(resumed), output=str(tmp_path), what="trained", flags=SFTSpec.flags()
        )


def test_a_manifest_value_of_the_wrong_type_names_the_file_and_the_key():
    bad = _manifest(ScoreSpec(input=("a",), model="/m", text_column="t"))
    bad["options"]["topk"] = "five"
    with pytest.raises(
        ValueError,
        match=r'/out/_manifest.json: "topk" holds \'five\', a str, where the option takes '
        r"an int; .*overwrite",
    ):
        ScoreSpec.build({}, manifest=bad, manifest_path="/out/_manifest.json")


@pytest.mark.parametrize("caller, named", [("python", "`topk`"), ("cli", "`--topk`")])
def test_a_given_value_of_the_wrong_type_names_the_option_as_the_caller_spells_it(caller, named):
    context = interface.cli() if caller == "cli" else interface.speaking("python")
    with context, pytest.raises(ValueError, match=f"{named} must be an integer, got '5'"):
        ScoreSpec.build({"input": "a", "model": "/m", "text_column": "t", "topk": "5"})


@pytest.mark.parametrize(
    "given, message",
    [
        ({"text_column": "t", "ids_column": "i"}, "give exactly one of"),
        ({"text_column": "t", "topk": -1}, "topk and task_tokens must be >= 0"),
        ({"text_column": "t", "decode_topk": True}, "decode_topk=True decodes the top-k ids"),
        ({"text_column": "t", "convention": "hf"}, "convention must be one of"),
        ({"text_column": "t", "precision": "int8"}, "precision must be auto, bf16, fp32 or fp16"),
        ({"text_column": "t", "prompt_length_column": "n"}, "prompt_length_column goes with ids_column"),
    ],
)
def test_a_spec_checks_itself_naming_the_option(given, message):
    with interface.speaking("python"), pytest.raises(ValueError, match=message):
        ScoreSpec(input=("a",), model="/m", **given)


def test_sft_checks_its_ranges_and_precisions():
    with interface.cli(), pytest.raises(ValueError, match="--save-every must be >= 1, got 0"):
        SFTSpec(input=("a",), model="/m", text_column="t", save_every=0)
    with interface.cli(), pytest.raises(ValueError, match="--precision must be auto, bf16 or fp32"):
        SFTSpec(input=("a",), model="/m", text_column="t", precision="fp16")


@pytest.mark.parametrize(
    "spec, function", [(ScoreSpec, "dask_lm.scoring.job:score_parquet"), (SFTSpec, "dask_lm.sft.job:sft_parquet")]
)
def test_every_option_of_a_spec_is_a_keyword_of_its_function_and_an_option_of_its_command(spec, function):
    import importlib

    from click.testing import CliRunner

    from dask_lm.cli import main

    module, name = function.split(":")
    params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    fields = {f.name for f, _o in options_of(spec)}
    assert fields <= set(params), f"{name} lacks {sorted(fields - set(params))}"
    command = main.commands["score" if spec is ScoreSpec else "sft"]
    flags = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}
    for f, o in options_of(spec):
        if not o.cli:
            continue
        spelled = o.flag or f"--{f.name.replace('_', '-')}"
        assert spelled in flags, f"dask-lm {command.name} has no {spelled}"
        help_text = next(p.help for p in command.params if spelled in (*p.opts, *p.secondary_opts))
        assert help_text == o.help, f"{spelled}: the command's help is not the spec's"
    assert CliRunner().invoke(main, [command.name, "--help"]).exit_code == 0


def test_specs_are_frozen_and_keyword_only():
    spec = ScoreSpec(input=("a",), model="/m", text_column="t")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.topk = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        ScoreSpec(("a",), "/m")  # type: ignore[misc]


def test_a_path_object_is_a_path_string():
    import pathlib

    spec = ScoreSpec.build({"input": [pathlib.Path("x/a.parquet")], "model": pathlib.Path("/m"), "text_column": "t"})
    assert spec.input == (os.path.join("x", "a.parquet"),) and spec.model == "/m"


def test_the_job_options_page_is_generated_from_the_specs():
    """docs/reference/jobs.md holds exactly what ``python -m dask_lm.job_options`` renders from the specs."""
    from dask_lm import job_options as doc

    assert doc.current() == doc.markdown(), "stale: run `python -m dask_lm.job_options --write`"
    for spec in (ScoreSpec, SFTSpec):
        for f, _o in options_of(spec):
            assert f"| `{f.name}` |" in doc.markdown(), f.name


# ------------------------------------------------------------------------- resume against a real output folder
def _rows(path, n, word="alpha"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"id": list(range(n)), "text": [f"{word} {i} beta gamma" for i in range(n)]}), path, compression="none"
    )  # same-length words: a file of the same size


@pytest.fixture()
def stopped_job(tiny, tmp_path):
    """An output as a scoring job leaves it when stopped right after it wrote its manifest (before any part): the
    job's own steps plan it, hash its files and pin them under its lock. Its inputs are a folder of two files."""
    from dask_lm.scoring.run import plan_job

    data = tmp_path / "data"
    data.mkdir()
    _rows(data / "a.parquet", 6)
    _rows(data / "b.parquet", 4)
    out = tmp_path / "out"
    spec = ScoreSpec(input=(str(data),), model=tiny["llama"], text_column="text", topk=2)
    job = plan_job(spec, out, resume=False, overwrite=False, revision=None)
    manifest, pins = job.manifest()
    with job.out.locked() as old:
        job.out.pin(manifest, old, pins)
    return data, out


def _resume(out, *args):
    from click.testing import CliRunner

    from dask_lm.cli import main

    return CliRunner().invoke(main, ["score", "--output", str(out), "--resume", "--no-progress", *args])


def test_a_resume_rebuilds_the_spec_from_the_folder_and_plans_the_same_job(stopped_job):
    from dask_lm.scoring.run import plan_job

    data, out = stopped_job
    spec = resume.spec_for(ScoreSpec, out, resume=True, given={})
    # the manifest pins the files the folder held, by path
    assert (spec.input, spec.text_column, spec.topk) == ((str(data / "a.parquet"), str(data / "b.parquet")), "text", 2)
    job = plan_job(spec, out, resume=True, overwrite=False, revision=None)  # the prechecks pass: nothing differs
    manifest, pins = job.manifest()
    with job.out.locked() as old:
        job.out.pin(manifest, old, pins)  # the content check passes too


@pytest.mark.parametrize(
    "change, named",
    [
        ("added", "input file {data}/c.parquet is new"),
        ("removed", "input file {data}/b.parquet is gone"),
        ("grown", "input file {data}/a.parquet changed: {old} -> {new} bytes"),
    ],
)
def test_an_input_file_added_removed_or_changed_is_named_before_any_cluster(stopped_job, no_cluster, change, named):
    data, out = stopped_job
    old = os.path.getsize(data / "a.parquet")
    if change == "added":
        _rows(data / "c.parquet", 3)
    elif change == "removed":
        os.remove(data / "b.parquet")
    else:
        _rows(data / "a.parquet", 60)
    result = _resume(out, str(data))  # the folder given again: a bare resume reads the files the manifest pins
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert named.format(data=data, old=old, new=os.path.getsize(data / "a.parquet")) in text, text
    assert "--overwrite" in text and not no_cluster


def test_an_input_changed_in_content_at_the_same_size_is_named_once_hashed(stopped_job):
    """Same size, other bytes: the prechecks (paths and sizes) cannot see it; the job's content check under its
    lock names it, before any part is written."""
    from dask_lm.scoring.run import plan_job

    data, out = stopped_job
    size = os.path.getsize(data / "a.parquet")
    _rows(data / "a.parquet", 6, word="omega")  # the same layout, other letters: same size, other bytes
    assert os.path.getsize(data / "a.parquet") == size
    job = plan_job(
        resume.spec_for(ScoreSpec, out, resume=True, given={}), out, resume=True, overwrite=False, revision=None
    )
    manifest, pins = job.manifest()
    with (
        pytest.raises(ValueError, match=r"a\.parquet changed: same size \(\d+ bytes\), different content"),
        job.out.locked() as old,
    ):
        job.out.pin(manifest, old, pins)
    assert not list(out.glob("part-*"))


def test_a_given_option_that_differs_is_named_with_both_values_before_any_cluster(stopped_job, no_cluster):
    _data, out = stopped_job
    result = _resume(out, "--topk", "3")
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "--topk was 2, now 3" in text and not no_cluster, text
