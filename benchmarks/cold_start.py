"""Where a fresh worker process's first second goes: imports, CUDA initialisation and the model load, phase by phase.

A benchmark, not a test. A scoring job on fresh workers pays all of this before its first token (``score.py``'s
"cold" row); this script times each phase in a new Python process (nothing imported, no CUDA context, the page
cache warm as it is for a worker), twice, and prints a table:

* ``import torch``, CUDA initialisation (the first tensor on the device), ``import transformers``;
* ``import dask_lm.scoring.scorer`` (what a scoring task unpickles);
* ``from_pretrained`` to the CPU, then ``.to(device)``: the path a replica took before this issue;
* ``from_pretrained`` with the process's default device set to the GPU: the weights are read from safetensors
  straight into device memory.

Examples
--------
    python benchmarks/cold_start.py --shape qwen2.5-0.5b
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import click
from common import SHAPE_CHOICES, build_model

_CHILD = r"""
import json, sys, time
t = time.perf_counter
out = {}
s = t(); import torch; out["import torch"] = t() - s
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
s = t(); torch.zeros(1, device=dev); torch.cuda.synchronize() if dev.type == "cuda" else None
out["CUDA init"] = t() - s
s = t(); import transformers; from transformers import AutoModelForCausalLM; out["import transformers"] = t() - s
s = t(); import dask_lm.scoring.scorer; out["import dask_lm.scoring.scorer"] = t() - s
path, how = sys.argv[1], sys.argv[2]
s = t()
if how == "cpu-then-to":
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev).eval()
else:
    try:
        with dev:
            m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    except ValueError as e:  # transformers wants accelerate for a device context
        print("RESULT " + json.dumps(dict(out, error=str(e)[:200])))
        sys.exit(0)
if dev.type == "cuda":
    torch.cuda.synchronize()
out[f"from_pretrained ({how})"] = t() - s
assert next(m.parameters()).device.type == dev.type
print("RESULT " + json.dumps(out))
"""


def _child(model_dir: str, how: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _CHILD, model_dir, how], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@click.command()
@click.option("--shape", type=click.Choice(SHAPE_CHOICES), default="tiny", show_default=True)
def main(shape: str) -> None:
    with tempfile.TemporaryDirectory(prefix="dask-lm-bench-") as root:
        model_dir = build_model(shape, root, 4096)
        runs = [_child(model_dir, how) for how in ("cpu-then-to", "default-device", "cpu-then-to", "default-device")]
    print(f"\n{'phase (fresh process), seconds per run':<44}" + "".join(f"{i + 1:>8}" for i in range(len(runs))))
    rows: dict[str, list[float]] = {}
    for r in runs:
        if "error" in r:
            print(f"{r['error']}")
        for k, v in r.items():
            if k == "error":
                continue
            rows.setdefault(k, []).append(v)
    for k, v in rows.items():
        print(f"{k:<44}" + "".join(f"{x:>8.2f}" for x in v))
    print(json.dumps({"shape": shape, "phases": rows}))


if __name__ == "__main__":
    main()
