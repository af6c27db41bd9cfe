"""Models named by Hugging Face Hub id, resolved through a Hub-layout cache made on the fly (no network:
``HF_HUB_OFFLINE=1``), as the Hub's own client lays it out: ``models--org--name/refs/<ref>`` holding a commit
hash, ``snapshots/<commit>/`` holding the files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers

import dask_lm
from dask_lm.io.hub import looks_like_hub_id, resolve_model

REPO = "dask-lm-tests/tiny-llama"
MAIN, TAGGED = "a" * 40, "b" * 40


@pytest.fixture
def hub_cache(tiny, tmp_path, monkeypatch):
    """A Hub cache holding REPO at two commits: ``main`` (the tiny llama) and tag ``v1`` (another checkpoint)."""
    cache = tmp_path / "hub"
    repo = cache / ("models--" + REPO.replace("/", "--"))
    for ref, commit, src in (("main", MAIN, tiny["llama"]), ("v1", TAGGED, tiny["llama_tuned"])):
        shutil.copytree(src, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_id_resolves_to_its_cached_snapshot_by_branch_and_tag(hub_cache, tiny):
    src = resolve_model(REPO)
    assert src.path == str(hub_cache / f"models--dask-lm-tests--tiny-llama/snapshots/{MAIN}")
    assert (src.hub_id, src.revision, src.commit) == (REPO, None, MAIN)
    tagged = resolve_model(REPO, revision="v1")
    assert tagged.commit == TAGGED and tagged.revision == "v1"
    # the snapshot holds the files a user's from_pretrained would load: the same weights as the source directory
    a = transformers.AutoModelForCausalLM.from_pretrained(tagged.path)
    b = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama_tuned"])
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    # a local directory stays what it is
    assert (
        resolve_model(tiny["llama"]).path == os.path.abspath(tiny["llama"])
        and resolve_model(tiny["llama"]).hub_id is None
    )


def test_missing_names_say_what_was_tried_and_the_fix(hub_cache, tmp_path):
    with pytest.raises(ValueError) as e:
        resolve_model("dask-lm-tests/not-there")
    msg = str(e.value)
    assert (
        "dask-lm-tests/not-there" in msg and str(hub_cache) in msg and "HF_HUB_OFFLINE" in msg and "hf download" in msg
    )
    with pytest.raises(ValueError, match="does not exist: pass a local Hugging Face model directory, or a Hub id"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model("./models/nope")
    with pytest.raises(ValueError, match="applies only to a Hub id"):
        resolve_model(str(tmp_path), revision="main")
    assert looks_like_hub_id("Qwen/Qwen2.5-0.5B") and looks_like_hub_id("gpt2")
    assert not any(looks_like_hub_id(p) for p in ("/models/qwen", "./m", "~/m", "a/b/c", "../m"))


@pytest.mark.cluster
def test_policy_and_score_parquet_take_a_hub_id_and_the_manifest_records_it(hub_cache, client, tiny, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(tiny["tokenizer"])
    texts = ["the cat sat on the mat", "dask schedules tasks on workers"]
    enc = tok(texts, padding=True, return_tensors="pt")
    batch = dask_lm.BatchedDataDict(input_ids=enc["input_ids"], input_lengths=enc["attention_mask"].sum(1))
    cfg = {"model_name": REPO, "model_revision": "v1", "precision": "float32"}
    with dask_lm.Policy(client, cfg, tok, init_optimizer=False, init_reference_model=False) as policy:
        assert policy.model_source.commit == TAGGED and policy.cfg.model_name.endswith(TAGGED)
        ours = policy.get_logprobs(batch)["logprobs"]
    # reference: a single-process forward of the directory the tag names
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama_tuned"], dtype=torch.float32)
    with torch.no_grad():
        logits = hf(enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    ref = torch.zeros_like(ours)
    ref[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(2, enc["input_ids"][:, 1:, None]).squeeze(2)
    ref *= enc["attention_mask"]
    torch.testing.assert_close(ours * enc["attention_mask"], ref, atol=1e-5, rtol=1e-5)

    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet")
    res = dask_lm.score_parquet(
        tmp_path / "d.parquet", tmp_path / "out", model=REPO, client=client, text_column="text", progress=False
    )
    assert res.rows == 2
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["model_source"] == {
        "path": str(hub_cache / f"models--dask-lm-tests--tiny-llama/snapshots/{MAIN}"),
        "hub_id": REPO,
        "revision": None,
        "commit": MAIN,
    }


def test_cli_names_a_missing_hub_model_with_exit_2_and_no_cluster(hub_cache, tmp_path):
    pq.write_table(pa.table({"text": ["a b c"]}), tmp_path / "d.parquet")
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dask_lm",
            "score",
            str(tmp_path / "d.parquet"),
            "--model",
            "Qwen/Qwen2.5-0.5B",
            "--output",
            str(tmp_path / "out"),
            "--text-column",
            "text",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "Qwen/Qwen2.5-0.5B" in out.stderr and "hf download Qwen/Qwen2.5-0.5B" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "out").exists()


def test_a_hub_repository_with_only_pickled_weights_is_refused(hub_cache, tiny):
    """Pickled ``.bin`` weights from the Hub are never fetched or loaded (unpickling runs the file's code)."""
    repo = hub_cache / "models--dask-lm-tests--pickles-only"
    snap = repo / "snapshots" / ("d" * 40)
    snap.mkdir(parents=True)
    shutil.copy(os.path.join(tiny["llama"], "config.json"), snap / "config.json")
    (snap / "pytorch_model.bin").write_bytes(b"not loaded")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("d" * 40)
    with pytest.raises(ValueError, match=r"no safetensors weights.*save_pretrained"):
        resolve_model("dask-lm-tests/pickles-only")
