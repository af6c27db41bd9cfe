"""Feed NeMo RL's own example and recipe configs for the DTensor path to dask-lm, as a NeMo RL user would.

    python tools/nemo_rl_configs.py /path/to/NeMo-RL [--verbose]

For every ``examples/configs/*.yaml`` and ``examples/configs/recipes/llm/**/*.yaml`` of the checkout, resolved with
NeMo RL's own loader (``nemo_rl.utils.config.load_config`` with its OmegaConf resolvers registered, as its
``examples/run_*.py`` do), the ``policy`` section (and a distillation config's ``teacher``, which NeMo RL also
hands to a Policy) goes to ``PolicyConfig.from_dict`` and ``check_optim_config``: what ``dask_lm.Policy``'s
constructor does with a config before it looks at the model (``dask_lm/engine/policy.py``). It prints one line per
config (accepted, accepted with warnings, or refused, with the keys) and the totals: how many, every kind of warning
with its count, and what refuses the rest, grouped by key.

"The DTensor path" is: ``policy.dtensor_cfg.enabled`` true and ``policy.megatron_cfg.enabled`` not true, and not a
vision-language config (a file name with ``vlm``: those are for ``examples/run_vlm_sft.py`` / ``run_vlm_grpo.py``,
as ``recipes/vlm/`` is). At NeMo RL 7ea279a that is 109 configs (17 SFT, 8 DPO, 84 GRPO / DAPO / PPO /
distillation / RM ones).

NeMo RL's loader needs ``omegaconf`` and ``hydra-core`` importable (and nothing else of NeMo RL's dependencies):
put them on ``PYTHONPATH`` (``build/nemo_rl_client/deps`` has them once ``../shared/nemo_rl_client/run.sh`` ran).
CI cannot run this (it cannot fetch NeMo RL); ``tests/test_nemo_configs.py`` checks the same rules on configs
written in the project."""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys
import warnings
from typing import Any

from dask_lm.config import PolicyConfig
from dask_lm.config.keys import findings
from dask_lm.config.optim import check_optim_config

SECTIONS = ("policy", "teacher")


def config_files(root: pathlib.Path) -> list[pathlib.Path]:
    configs = root / "examples" / "configs"
    return sorted(configs.glob("*.yaml")) + sorted((configs / "recipes" / "llm").rglob("*.yaml"))


def load(root: pathlib.Path, path: pathlib.Path) -> dict[str, Any]:
    """The config's policy-like sections, resolved by NeMo RL's own loader (only those: other sections may name
    environment variables such as HF_HOME that this process need not have)."""
    from nemo_rl.utils.config import load_config, register_omegaconf_resolvers
    from omegaconf import OmegaConf

    with warnings.catch_warnings():  # omegaconf 2.4 deprecates the call NeMo RL makes; not ours to report
        warnings.simplefilter("ignore")
        register_omegaconf_resolvers()
    cfg = load_config(str(path))
    return {
        name: OmegaConf.to_container(cfg[name], resolve=True)
        for name in SECTIONS
        if name in cfg and cfg[name] is not None
    }


def on_dtensor_path(path: pathlib.Path, sections: dict[str, Any]) -> bool:
    policy = sections.get("policy") or {}
    dtensor = (policy.get("dtensor_cfg") or {}).get("enabled", False)
    megatron = (policy.get("megatron_cfg") or {}).get("enabled", False)
    return bool(dtensor) and not megatron and "vlm" not in path.name


def check(section: dict[str, Any]) -> tuple[list[str], str | None, list[str]]:
    """``(warning lines, the refusal, every key refused)`` of one policy section, as ``Policy(...)`` sees it."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        try:
            cfg = PolicyConfig.from_dict(section)
            if cfg.optimizer is not None:
                check_optim_config(cfg)
            error = None
        except ValueError as e:
            error = str(e)
    lines = [line[2:] for w in got for line in str(w.message).splitlines() if line.startswith("- ")]
    refused = [f.key for f in findings(section) if f.action == "refuse"]
    return lines, error, refused


def warning_kind(line: str) -> str:
    """A warning line without its value: ``policy.generation.backend`` (and FusedAdam's notes kept apart)."""
    key = re.match(r"`([^`]+)`", line)
    return key.group(1) if key else line


def refusal_kind(error: str) -> str:
    key = re.match(r"`([^`]+)`", error) or re.search(r"`(policy\.[^`]+)`", error)
    return key.group(1) if key else error.split(":")[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("nemo_rl", type=pathlib.Path, help="a NeMo RL checkout (its examples/ and nemo_rl/)")
    parser.add_argument("--verbose", action="store_true", help="print each config's warning lines too")
    args = parser.parse_args(argv)
    root = args.nemo_rl.resolve()
    sys.path.insert(0, str(root))
    accepted = warned = refused = 0
    warning_kinds: collections.Counter[str] = collections.Counter()
    refusals: collections.Counter[str] = collections.Counter()  # the key that stops each refused config
    all_refused: collections.Counter[str] = collections.Counter()  # every refused key of each refused config
    skipped = 0
    for path in config_files(root):
        name = str(path.relative_to(root / "examples" / "configs"))
        try:
            sections = load(root, path)
        except Exception as e:
            print(f"unresolved  {name}: {type(e).__name__}: {str(e).splitlines()[0]}")
            skipped += 1
            continue
        if not on_dtensor_path(path, sections):
            continue
        lines: list[str] = []
        errors: list[str] = []
        keys: set[str] = set()
        for section_name in SECTIONS:
            if section_name in sections:
                got, error, refused_keys = check(sections[section_name])
                lines += [f"{section_name}: {line}" if section_name != "policy" else line for line in got]
                if error:
                    if not errors:  # the first refusal is the one a user meets
                        kind = refusal_kind(error)
                        refusals[kind if section_name == "policy" else f"{section_name}: {kind}"] += 1
                    errors.append(f"{section_name}: {error}")
                    keys |= {
                        f"{section_name}.{k}" if section_name != "policy" else f"policy.{k}" for k in refused_keys
                    } or {refusal_kind(error)}
        if errors:
            refused += 1
            all_refused.update(keys)
            print(
                f"refused     {name}: {errors[0][:300]}"
                + (f"  [all refused keys: {', '.join(sorted(keys))}]" if len(keys) > 1 else "")
            )
            continue
        warning_kinds.update({warning_kind(line) for line in lines})
        if lines:
            warned += 1
            print(
                f"accepted    {name}: {len(lines)} warning line(s): "
                f"{', '.join(sorted({warning_kind(line) for line in lines}))}"
            )
            if args.verbose:
                for line in lines:
                    print(f"              {line}")
        else:
            accepted += 1
            print(f"accepted    {name}")
    total = accepted + warned + refused
    print(
        f"\n{total} configs on the DTensor path: {accepted + warned} accepted ({accepted} silently, {warned} with "
        f"warnings), {refused} refused" + (f"; {skipped} could not be resolved here" if skipped else "")
    )
    print("\nwarning kinds (configs):")
    for kind, n in warning_kinds.most_common():
        print(f"  {n:4d}  {kind}")
    print("\nrefused, by the key that stops the config (configs):")
    for kind, n in refusals.most_common():
        print(f"  {n:4d}  {kind}")
    print("\nrefused, every key each refused config would need changed (configs):")
    for kind, n in all_refused.most_common():
        print(f"  {n:4d}  {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
