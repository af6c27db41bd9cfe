"""A scoring replica's model load, as a fresh worker pays it: from_pretrained against dask-lm's direct load.

A benchmark, not a test: it prints numbers and asserts nothing about speed. A random model directory of the
shape (bf16 safetensors, saved with ``save_pretrained``) is loaded in fresh processes, one per arm and page-cache
state, each timing its phases from the process start:

* ``read``: the weight files read raw into pinned host memory and copied to the device; the disk's (or the page
  cache's) pace, the floor for any load;
* ``from_pretrained``: ``AutoModelForCausalLM.from_pretrained(dtype=bf16, device_map={"": device})``, what
  dask-lm did before (``dask_lm.model.load._from_pretrained``);
* ``direct``: ``dask_lm.model.load.load_causal_lm``: built on the device without the random init, each
  tensor copied once from the files.

Each runs with the files in the page cache (``warm``, as after a download or a previous job) and, with
``--cold``, after ``posix_fadvise(DONTNEED)`` has dropped them (a first read from the disk; it needs no root).
Phases: ``torch`` (import), ``cuda`` (the context), ``transformers`` (``modeling_utils``'s import: torch.distributed,
dynamo, scipy), ``load`` (the call itself, synchronised); the GB/s are the weights' bytes over ``load``.
``--profile`` adds a cProfile of each load call, the top entries by cumulative time.

Examples
--------
    python benchmarks/model_load.py --shape qwen2.5-0.5b --cold
    python benchmarks/model_load.py --shape qwen2.5-1.5b --profile
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import click

HERE = os.path.dirname(os.path.abspath(__file__))
ARMS = ("read", "from_pretrained", "direct")


def _weights(model_dir: str) -> list[str]:
    return sorted(os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors"))


def drop_page_cache(paths: list[str]) -> None:
    """Ask the kernel to drop ``paths``' clean pages (no root needed for files one can open)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def child(arm: str, model_dir: str, profile: bool, started: float) -> dict[str, float | str]:
    """One arm in this (fresh) process: the phases' seconds, from ``started`` (the parent's clock at spawn)."""
    marks: dict[str, float | str] = {"spawn": time.time() - started}
    t = time.perf_counter()

    def mark(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        marks[name] = now - t
        t = now

    import torch

    mark("torch")
    where = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if where.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=where)
    mark("cuda")
    if arm != "read":
        import transformers.modeling_utils  # noqa: F401
    mark("transformers")
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    if arm == "read":
        for path in _weights(model_dir):
            size = os.path.getsize(path)
            host = torch.empty(size, dtype=torch.uint8, pin_memory=where.type == "cuda")
            with open(path, "rb", buffering=0) as f:
                f.readinto(memoryview(host.numpy()))
            host.to(where)
    else:
        from dask_lm.model import load as model_load

        if arm == "direct":
            _model = model_load.load_causal_lm(model_dir, torch.bfloat16, where)  # held until the marks are taken
        else:
            _model = model_load._from_pretrained(model_dir, torch.bfloat16, where)
        marks["direct_path"] = str(arm == "direct" and model_load.direct_files(model_dir) is not None)
    if where.type == "cuda":
        torch.cuda.synchronize()
    mark("load")
    if prof is not None:
        import io
        import pstats

        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(25)
        marks["profile"] = buf.getvalue()
    return marks


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--shape", default="qwen2.5-0.5b", show_default=True, help="The model shape (benchmarks/common.py).")
@click.option("--cold", is_flag=True, help="Also run every arm with the weights dropped from the page cache.")
@click.option("--profile", is_flag=True, help="cProfile each load call (top 25 by cumulative time).")
@click.option("--repeat", default=2, show_default=True, help="Runs of each arm and state (the minimum is shown).")
@click.option("--child", "child_arm", type=click.Choice(ARMS), hidden=True)
@click.option("--model-dir", hidden=True)
@click.option("--started", type=float, hidden=True)
def main(
    shape: str,
    cold: bool,
    profile: bool,
    repeat: int,
    child_arm: str | None,
    model_dir: str | None,
    started: float | None,
) -> None:
    if child_arm is not None:
        assert model_dir is not None and started is not None
        print(json.dumps(child(child_arm, model_dir, profile, started)))
        return
    sys.path.insert(0, HERE)
    from common import build_model

    with tempfile.TemporaryDirectory(prefix="dask-lm-load-") as root:
        model_dir = build_model(shape, root, 4096)
        files = _weights(model_dir)
        gb = sum(os.path.getsize(f) for f in files) / 1e9
        print(f"{shape}: {gb:.2f} GB of safetensors in {len(files)} file(s)", flush=True)
        states = ["warm", "cold"] if cold else ["warm"]
        rows = []
        for state in states:
            for arm in ARMS:
                best: dict[str, float | str] | None = None
                for _ in range(repeat):
                    if state == "cold":
                        drop_page_cache(files)
                    else:  # one read first, so the arm finds the files in the page cache
                        for f in files:
                            with open(f, "rb") as fh:
                                while fh.read(1 << 24):
                                    pass
                    t0 = time.time()
                    proc = subprocess.run(
                        [
                            sys.executable,
                            __file__,
                            "--child",
                            arm,
                            "--model-dir",
                            model_dir,
                            "--started",
                            repr(t0),
                            *(["--profile"] if profile else []),
                        ],
                        capture_output=True,
                        text=True,
                    )
                    wall = time.time() - t0
                    if proc.returncode != 0:
                        raise RuntimeError(f"{arm} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
                    got = json.loads(proc.stdout.strip().splitlines()[-1])
                    got["process"] = wall
                    if best is None or float(got["load"]) < float(best["load"]):
                        best = got
                assert best is not None
                rows.append((state, arm, best))
                if profile and "profile" in best:
                    print(f"--- {state} {arm}: cProfile of the load call\n{best['profile']}", flush=True)
        cols = ("spawn", "torch", "cuda", "transformers", "load")
        print(f"\n| page cache | arm | {' | '.join(cols)} | process | load GB/s |")
        print("|---" * (len(cols) + 4) + "|")
        for state, arm, got in rows:
            vals = " | ".join(f"{float(got[c]):.2f}" for c in cols)
            print(f"| {state} | {arm} | {vals} | {float(got['process']):.2f} | {gb / float(got['load']):.2f} |")
        print(
            json.dumps(
                {
                    "shape": shape,
                    "gb": gb,
                    "rows": [
                        {"state": s, "arm": a, **{k: v for k, v in g.items() if k != "profile"}} for s, a, g in rows
                    ],
                }
            )
        )


if __name__ == "__main__":
    main()
