"""The command's help is worth reading: every option of every subcommand says what it does, every subcommand shows
examples, shared options have one spelling (``--precision auto|bf16|fp32|fp16``; the torch names ``logprobs`` once
took still work, unlisted)."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from dask_lm.cli import main as cli

COMMANDS = sorted(cli.commands)


def test_every_option_is_described_and_every_command_has_examples():
    assert {"score", "sft", "logprobs", "demo"} <= set(COMMANDS)
    for name in COMMANDS:
        cmd = cli.commands[name]
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert param.help, f"dask-lm {name} {param.opts[0]} has no help text"
        out = CliRunner().invoke(cli, [name, "--help"])
        assert out.exit_code == 0 and "Examples:" in out.output and f"dask-lm {name} " in out.output, name


def test_precision_is_spelled_one_way_and_old_spellings_still_parse():
    shared = {}
    for name in COMMANDS:
        opt = next((p for p in cli.commands[name].params if p.name == "precision"), None)
        if opt is not None:
            shared[name] = list(opt.type.choices)
    assert set(shared) == {"logprobs", "score", "sft"}
    assert all(choices[:3] == ["auto", "bf16", "fp32"] for choices in shared.values()), shared
    opt = next(p for p in cli.commands["logprobs"].params if p.name == "precision")
    for old, new in (("bfloat16", "bf16"), ("float32", "fp32"), ("float16", "fp16"), ("fp32", "fp32")):
        assert opt.type.convert(old, opt, None) == new
    with pytest.raises(click.BadParameter):
        opt.type.convert("int8", opt, None)


def test_the_exit_codes_in_the_help_include_the_interrupted_ones():
    """130 (Ctrl-C) and 143 (SIGTERM) are exit codes like the others (docs/reference/exit-codes.md): the command's help
    and each job command's list them with 0, 1 and 2."""
    for args in ([], ["score"], ["sft"]):
        out = CliRunner().invoke(cli, [*args, "--help"])
        text = " ".join(out.output.split())  # click wraps the epilog
        assert out.exit_code == 0 and "Exit codes" in text, args
        for code in ("0 done", "1 a runtime failure", "130 interrupted by Ctrl-C (SIGINT)", "143 by SIGTERM"):
            assert code in text, (args, code, text)
