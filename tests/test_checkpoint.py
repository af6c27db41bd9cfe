"""Checkpoints: Hugging Face directories that from_pretrained loads, exact resume, atomic publication."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import transformers
from helpers import TEXTS, WritesMarker, model_logprobs, sft_batch

import dask_lm
from dask_lm.io import checkpoint as ckpt

# `cluster` is marked per test here, not for the module: the tests without it start no cluster and run in the fast tier
# (pytest -m "not cluster")

CORPUS = TEXTS + ["Checkpoints appear whole or not at all.", "Resume continues the same run.", "Eight rows."]


def _cfg(model_dir, **extra):
    cfg = {
        "model_name": model_dir,
        "precision": "float32",
        "train_global_batch_size": 8,
        "train_micro_batch_size": 2,
        "logprob_chunk_size": 5,
        "max_total_sequence_length": 128,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": [
            {
                "name": "torch.optim.lr_scheduler.LinearLR",
                "kwargs": {"start_factor": 0.5, "end_factor": 1.0, "total_iters": 3},
            },
            {"name": "torch.optim.lr_scheduler.ConstantLR", "kwargs": {"factor": 1.0, "total_iters": 1}},
            {"milestones": [3]},
        ],
    }
    cfg.update(extra)
    return cfg


@pytest.fixture(scope="module")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny["llama"])


@pytest.fixture(scope="module")
def batches(tok):
    return sft_batch(tok, CORPUS), sft_batch(tok, list(reversed(CORPUS)))


@pytest.mark.cluster
@pytest.mark.parametrize("save_ranks,load_ranks", [(2, 2), (2, 1), (1, 2)])
def test_round_trip_continues_identically(client, tiny, tok, batches, tmp_path, save_ranks, load_ranks):
    """Save after a step; a new Policy restored from it gives the same logprobs, keeps the base model as its
    reference, and takes exactly the next step the original would have taken (also across rank counts)."""
    first, second = batches
    w, o, t = tmp_path / "weights", tmp_path / "optimizer", tmp_path / "tokenizer"
    with dask_lm.Policy(client, _cfg(tiny["qwen2"]), tok, workers_per_node=save_ranks) as policy:
        policy.train(first, dask_lm.NLLLoss())
        saved_lp = policy.get_logprobs(first)["logprobs"]
        policy.save_checkpoint(w, optimizer_path=o, tokenizer_path=t)
        base_ref = policy.get_reference_policy_logprobs(first)["reference_logprobs"]
        cont = policy.train(second, dask_lm.NLLLoss())
        cont_lp = policy.get_logprobs(second)["logprobs"]
    # a Hugging Face directory: from_pretrained loads it as users do, and it scores what the policy scored
    assert (w / "config.json").exists() and (w / "model.safetensors").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(w, dtype=torch.float32)
    torch.testing.assert_close(
        model_logprobs(hf, first["input_ids"], first["input_lengths"]), saved_lp, atol=1e-5, rtol=0
    )
    assert transformers.AutoTokenizer.from_pretrained(t)("Dask")["input_ids"] == tok("Dask")["input_ids"]
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # nothing left under a temporary name
    with dask_lm.Policy(
        client, _cfg(tiny["qwen2"]), tok, workers_per_node=load_ranks, weights_path=w, optimizer_path=o
    ) as restored:
        torch.testing.assert_close(restored.get_logprobs(first)["logprobs"], saved_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            restored.get_reference_policy_logprobs(first)["reference_logprobs"], base_ref, atol=1e-5, rtol=0
        )
        again = restored.train(second, dask_lm.NLLLoss())
        torch.testing.assert_close(restored.get_logprobs(second)["logprobs"], cont_lp, atol=1e-5, rtol=0)
    assert float(again["loss"][0]) == pytest.approx(float(cont["loss"][0]), abs=1e-6)
    assert float(again["grad_norm"][0]) == pytest.approx(float(cont["grad_norm"][0]), rel=1e-5)
    assert again["all_mb_metrics"]["lr"][0] == pytest.approx(cont["all_mb_metrics"]["lr"][0])


@pytest.mark.cluster
def test_sharded_async_save_appears_only_when_complete(client, tiny, tok, batches, tmp_path):
    first, _ = batches
    w, o = tmp_path / "ckpt" / "weights", tmp_path / "ckpt" / "optimizer"
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok) as policy:
        policy.train(first, dask_lm.NLLLoss())
        lp = policy.get_logprobs(first)["logprobs"]
        policy.save_checkpoint(
            w,
            optimizer_path=o,
            checkpointing_cfg={"async_save": True, "max_shard_size": 40_000, "checkpoint_dir": str(tmp_path)},
        )
        assert not w.exists() and not o.exists()  # staged, not published
        policy.train(first, dask_lm.NLLLoss())  # training goes on while the bytes are written
        policy.finalize_async_save()
    index = json.loads((w / ckpt.WEIGHTS_INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((w / f).exists() for f in files)
    assert (o / ".metadata").exists() and (o / "scheduler.pt").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(w, dtype=torch.float32)
    torch.testing.assert_close(model_logprobs(hf, first["input_ids"], first["input_lengths"]), lp, atol=1e-5, rtol=0)


@pytest.mark.cluster
def test_bf16_policy_keeps_fp32_masters(client, tiny, tok, batches, tmp_path):
    """A bf16 policy trains fp32 master weights: an AdamW step of 1e-5 moves weights by ~1e-5, far below bf16's
    resolution, and the saved checkpoint (fp32) shows it on one rank and on two."""
    first, _ = batches
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32).state_dict()
    for ranks in (1, 2):
        cfg = _cfg(
            tiny["llama"],
            precision="bfloat16",
            scheduler=None,
            max_grad_norm=None,
            optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-5, "weight_decay": 0.0}},
        )
        with dask_lm.Policy(client, cfg, tok, workers_per_node=ranks) as policy:
            policy.train(first, dask_lm.NLLLoss())
            policy.save_checkpoint(tmp_path / f"w{ranks}")
        saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"w{ranks}").state_dict()
        name = "model.layers.0.mlp.up_proj.weight"
        assert saved[name].dtype == torch.float32
        delta = (saved[name] - base[name]).abs()
        assert 5e-6 < float(delta.max()) < 2e-5, float(delta.max())  # Adam's first step moves each weight by ~lr
        assert float(delta.median()) > 1e-6


@pytest.mark.cluster
def test_bad_checkpoint_arguments(client, tiny, tok, tmp_path):
    (tmp_path / "file").write_text("x")
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok, init_optimizer=False) as policy:
        with pytest.raises(ValueError, match="init_optimizer=False"):
            policy.save_checkpoint(tmp_path / "w", optimizer_path=tmp_path / "o")
        with pytest.raises(ValueError, match="not a directory"):
            policy.save_checkpoint(tmp_path / "file")
        with pytest.raises(ValueError, match="model_save_format"):
            policy.save_checkpoint(tmp_path / "w", checkpointing_cfg={"model_save_format": "torch_save"})
    assert sorted(os.listdir(tmp_path)) == ["file"]
    with pytest.raises(ValueError, match="optimizer checkpoint"):
        dask_lm.Policy(client, _cfg(tiny["llama"]), tok, optimizer_path=tmp_path)


_WRITER = textwrap.dedent("""
    import sys, time, torch
    from dask_lm.io import checkpoint as ckpt
    final, marker = sys.argv[1], sys.argv[2]
    tmp = ckpt.temporary_sibling(final)
    import os
    os.makedirs(tmp)
    tensors = {f"t{i}": torch.full((1000,), float(i)) for i in range(8)}
    shards = ckpt.plan_shards([(k, v.shape, v.dtype) for k, v in tensors.items()], 4000)
    for i, names in enumerate(shards):
        ckpt.write_shard(tmp, i, len(shards), {n: tensors[n] for n in names})
        if i == 1:
            open(marker, "w").close()  # half written: the parent kills us now
            time.sleep(60)
    ckpt.write_index(tmp, shards, 32000)
    ckpt.publish(tmp, final)
""")


def test_killed_save_leaves_previous_checkpoint_intact(tmp_path):
    """SIGKILL in the middle of writing: the final name still holds the previous complete checkpoint."""
    final = tmp_path / "weights"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"previous")
    marker = tmp_path / "half-written"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(final), str(marker)])
    try:
        deadline = time.time() + 60
        while not marker.exists():
            assert proc.poll() is None, "the writer exited early"
            assert time.time() < deadline, "the writer never got half way"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sorted(os.listdir(final)) == ["model.safetensors"]
    assert (final / "model.safetensors").read_bytes() == b"previous"
    debris = [p for p in os.listdir(tmp_path) if p.startswith(".weights.tmp-")]
    assert len(debris) == 1 and len(os.listdir(tmp_path / debris[0])) == 2  # the partial write, under its tmp name


def test_publish_replaces_only_when_complete(tmp_path):
    final = tmp_path / "w"
    final.mkdir()
    (final / "old").write_text("1")
    tmp = ckpt.temporary_sibling(str(final))
    os.makedirs(tmp)
    (tmp_path / os.path.basename(tmp) / "new").write_text("2")
    ckpt.publish(tmp, str(final))
    assert sorted(os.listdir(final)) == ["new"]
    assert sorted(os.listdir(tmp_path)) == ["w"]
    assert ckpt.parse_size("5GB") == 5 * 10**9 and ckpt.parse_size("2MiB") == 2 * 2**20
    with pytest.raises(ValueError, match="max_shard_size"):
        ckpt.parse_size("lots")


@pytest.mark.cluster
@pytest.mark.parametrize("async_save", [False, True])
def test_a_failure_on_one_rank_discards_everything_and_the_policy_saves_again(
    client, tiny, tok, batches, tmp_path, async_save
):
    """Rank 0 fails after the weights are gathered (its tokenizer save raises): every rank learns of it, nothing
    is published, no temporary directory is left, and the next save works."""
    from types import SimpleNamespace

    first, _ = batches
    paths = {"weights_path": tmp_path / "w", "optimizer_path": tmp_path / "o", "tokenizer_path": tmp_path / "t"}
    cfg = {"async_save": async_save}
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok) as policy:
        policy.train(first, dask_lm.NLLLoss())
        real = policy.tokenizer
        policy.tokenizer = SimpleNamespace(save_pretrained=os.mkdir)  # the directory exists: FileExistsError
        with pytest.raises(Exception, match="File exists"):
            policy.save_checkpoint(**paths, checkpointing_cfg=cfg)
            policy.finalize_async_save()
        assert os.listdir(tmp_path) == []
        policy.tokenizer = real
        policy.save_checkpoint(**paths, checkpointing_cfg=cfg)
        policy.finalize_async_save()
    assert sorted(os.listdir(tmp_path)) == ["o", "t", "w"]


@pytest.mark.cluster
def test_nested_or_foreign_directories_are_refused(client, tiny, tok, tmp_path):
    foreign = tmp_path / "results"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok) as policy:
        with pytest.raises(ValueError, match="neither inside the other"):
            policy.save_checkpoint(tmp_path / "o" / "w", optimizer_path=tmp_path / "o")
        with pytest.raises(ValueError, match="does not look like a checkpoint"):
            policy.save_checkpoint(foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["results"]


@pytest.mark.cluster
def test_optimizer_saved_before_any_step_restores_the_same_first_step(client, tiny, tok, batches, tmp_path):
    first, _ = batches
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok) as policy:
        policy.save_checkpoint(tmp_path / "w", optimizer_path=tmp_path / "o")
        expected = policy.train(first, dask_lm.NLLLoss())
        after = policy.get_logprobs(first)["logprobs"]
    with dask_lm.Policy(
        client, _cfg(tiny["llama"]), tok, weights_path=tmp_path / "w", optimizer_path=tmp_path / "o"
    ) as restored:
        got = restored.train(first, dask_lm.NLLLoss())
        torch.testing.assert_close(restored.get_logprobs(first)["logprobs"], after, atol=1e-5, rtol=0)
    assert float(got["loss"][0]) == pytest.approx(float(expected["loss"][0]), abs=1e-6)


# ----------------------------------------------------------------------------------------- tampered checkpoints
@pytest.fixture(scope="module")
def saved(client, tiny, tok, batches, tmp_path_factory):
    """Weights and optimizer state of a policy after one step, as save_checkpoint wrote them."""
    root = tmp_path_factory.mktemp("saved")
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok) as policy:
        policy.train(batches[0], dask_lm.NLLLoss())
        policy.save_checkpoint(root / "w", optimizer_path=root / "o")
    return root / "w", root / "o"


def _tampered_copy(saved, tmp_path):
    import shutil

    o = tmp_path / "o"
    shutil.copytree(saved[1], o)
    return saved[0], o


def _restore(client, tiny, tok, w, o):
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok, weights_path=w, optimizer_path=o):
        pass


@pytest.mark.cluster
def test_tampered_scheduler_state_is_refused_not_run(client, tiny, tok, saved, tmp_path):
    import re

    w, o = _tampered_copy(saved, tmp_path)
    marker = tmp_path / "pwned"
    torch.save({"last_epoch": WritesMarker(marker)}, o / "scheduler.pt")
    with pytest.raises(ValueError, match=re.escape(str(o / "scheduler.pt"))) as err:
        _restore(client, tiny, tok, w, o)
    assert "plain data" in str(err.value)
    assert not marker.exists()


@pytest.mark.cluster
def test_tampered_dcp_metadata_is_refused_not_run(client, tiny, tok, saved, tmp_path):
    """DCP's .metadata is a plain pickle (torch reads it with pickle.load): one that names anything beyond DCP's
    metadata classes is refused before torch reads it."""
    import pickle
    import re

    w, o = _tampered_copy(saved, tmp_path)
    marker = tmp_path / "pwned"
    with open(o / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own, untampered file
    metadata.planner_data["extra"] = WritesMarker(marker)
    with open(o / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(ValueError, match=re.escape(str(o / ".metadata"))) as err:
        _restore(client, tiny, tok, w, o)
    assert "refers to io.open" in str(err.value)
    assert not marker.exists()


@pytest.mark.cluster
def test_tampered_optimizer_item_is_refused_not_run(client, tiny, tok, saved, tmp_path):
    """Non-tensor optimizer state (lr, betas, ...) is a torch.save blob inside a .distcp file, which DCP's own
    planner loads with weights_only=False: one holding code is refused."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    w, o = saved[0], tmp_path / "o"
    marker = tmp_path / "pwned"
    dcp_to_torch_save(saved[1], tmp_path / "plain.pt")
    state = torch.load(tmp_path / "plain.pt", weights_only=False)  # the test's own, untampered file
    state["optim"]["param_groups"][0]["lr"] = WritesMarker(marker)
    dcp.save(state, checkpoint_id=o, no_dist=True)  # the same items, the lr one tampered
    (o / "scheduler.pt").write_bytes((saved[1] / "scheduler.pt").read_bytes())
    assert not marker.exists()
    with pytest.raises(ValueError, match=r"item 'optim\.param_groups\.0\.lr' does not hold plain data") as err:
        _restore(client, tiny, tok, w, o)
    assert str(o) in str(err.value)
    assert not marker.exists()


# ----------------------------------------------------------------------------------------- write errors
def test_a_dcp_write_error_becomes_one_line_naming_the_path(tmp_path, monkeypatch):
    """DCP wraps a rank's failure into a message that is a whole traceback; the error users see is one line: the
    checkpoint path, the operating system's reason, the fix."""
    import errno

    import torch.distributed.checkpoint as dcp

    class FailsToSerialise:
        def __reduce__(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    path = tmp_path / "o"
    with pytest.raises(BaseException) as raw:
        dcp.save({"t": torch.zeros(3), "x": FailsToSerialise()}, checkpoint_id=path, no_dist=True)
    assert "\n" in str(raw.value)  # what DCP raises: a traceback as its message
    err = ckpt.write_error(raw.value, str(path))
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert str(err) == (
        f"could not write the checkpoint {path}: No space left on device; free space on that "
        "filesystem (or raise the quota) or save to another directory, then save again"
    )
    # what is not a filesystem error stays as it was (a peer lost in a collective, a user's mistake)
    for other in (RuntimeError("Connection closed by peer"), ValueError("bad key")):
        assert ckpt.write_error(other, str(path)) is other
        # however full the disk: a lost peer is not a full disk
        monkeypatch.setattr(ckpt, "_free_bytes", lambda _p: 0)
        assert ckpt.write_error(other, str(path)) is other
        monkeypatch.undo()


@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB tmpfs: any checkpoint of the tiny model fills it (mounting needs root; skipped otherwise)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.cluster
def test_async_save_to_a_full_disk_fails_with_one_clear_line(client, tiny, tok, batches, full_disk):
    first, _ = batches
    w, o = full_disk / "w", full_disk / "o"
    with dask_lm.Policy(client, _cfg(tiny["llama"]), tok) as policy:
        policy.train(first, dask_lm.NLLLoss())
        with pytest.raises(Exception) as err:
            policy.save_checkpoint(w, optimizer_path=o, checkpointing_cfg={"async_save": True})
            policy.finalize_async_save()
    message = str(err.value)
    assert "\n" not in message, message
    assert "No space left on device" in message and "free space on that filesystem" in message
    assert str(w) in message or str(o) in message
    assert os.listdir(full_disk) == []  # nothing published, nothing left under a temporary name
