"""NeMo RL's WeightSynchronizer for the SGLang refit (dask_lm/refit/weight_sync.py), driven the way NeMo RL drives
one: ``create_weight_synchronizer(...)``, ``init_communicator()``, ``is_stale`` read before the first refit,
``sync_weights(timer=, kv_scales=)`` per refit, ``shutdown()``.

The expected call order and meanings are NeMo RL's, written out here from its source at 7ea279a:
``nemo_rl/weight_sync/http_weight_synchronizer.py:21-26`` (offload_before_refit, prepare_for_generation(tags=
["weights"]), stream_weights_via_http, offload_after_refit, prepare_for_generation(tags=["kv_cache"])),
``:103-105`` (init_communicator: policy.prepare_refit_info() handed to generation.prepare_refit_info),
``:110-126`` (the buffer size) and ``interfaces.py:100-111`` (is_stale: True until a sync succeeds; per-step
staleness is the loop's). The cluster tests check what the fake SGLang server (tests/sglang_server.py, SGLang's own
decoder) ends up holding against what the trained policy's checkpoint holds."""

from __future__ import annotations

import hashlib

import pytest
import torch
import transformers
from helpers import TEXTS, make_batch, saved_weights, sft_batch
from sglang_server import start_server

import dask_lm
from dask_lm import BatchedDataDict
from dask_lm.refit.weight_sync import (
    HTTPWeightSynchronizer,
    SGLangEngines,
    WeightSynchronizer,
    create_weight_synchronizer,
)

GIB = 2**30
BUFFER_GB = 64 * 1024 / GIB  # several buckets for the tiny model


# ----------------------------------------------------------------------------------------- the call sequence
class _Client:
    def __init__(self, log, fail):
        self.log, self.fail = log, fail

    def gather(self, futures):
        self.log.append(("gather", len(futures)))
        if self.fail:
            raise dask_lm.RefitError("SGLang server http://h:1 refused bucket 2/5: injected")
        return [{"bytes": 100, "buckets": 5, "seconds": 0.5}, {"bytes": 40, "buckets": 5, "seconds": 0.25}]


class _Policy:
    """Records what the synchronizer calls, with NeMo RL's argument names."""

    def __init__(self, fail=False, free=1000 * GIB):
        self.log = []
        self.client = _Client(self.log, fail)
        self.free = free

    def set_rollout_num_gpus_per_engine(self, n):
        self.log.append(("set_rollout_num_gpus_per_engine", n))

    def prepare_refit_info(self):
        self.log.append(("prepare_refit_info",))
        return {"w": ((2, 2), torch.float32)}

    def offload_before_refit(self):
        self.log.append(("offload_before_refit",))

    def offload_after_refit(self):
        self.log.append(("offload_after_refit",))

    def get_free_memory_bytes(self):
        self.log.append(("get_free_memory_bytes",))
        return self.free

    def stream_weights_via_http(self, *, rollout_engine_urls, buffer_size_bytes):
        self.log.append(("stream_weights_via_http", tuple(rollout_engine_urls), buffer_size_bytes))
        return ["f0", "f1"]


class _Engines(SGLangEngines):
    def __init__(self, log, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = log

    def prepare_refit_info(self, state_dict_info):
        self.log.append(("generation.prepare_refit_info", tuple(state_dict_info)))

    def prepare_for_generation(self, *args, **kwargs):
        self.log.append(("generation.prepare_for_generation", kwargs.get("tags")))
        return True


def _pair(fail=False, **kwargs):
    policy = _Policy(fail=fail)
    engines = _Engines(policy.log, ["http://h:1", "http://h:2/"], num_gpus_per_engine=2)
    return policy, engines, create_weight_synchronizer(policy, engines, "sglang", True, **kwargs)


def test_nemo_rl_http_sequence_and_staleness():
    policy, _, sync = _pair(refit_buffer_size_gb=0.5)
    assert isinstance(sync, WeightSynchronizer) and isinstance(sync, HTTPWeightSynchronizer)
    sync.init_communicator()
    assert policy.log == [
        ("set_rollout_num_gpus_per_engine", 2),
        ("prepare_refit_info",),
        ("generation.prepare_refit_info", ("w",)),
    ]
    assert sync.is_stale  # a fresh run syncs first (grpo.py:2422-2427 reads this with no completed step)
    del policy.log[:]
    timer = dask_lm.Timer()
    metrics = sync.sync_weights(timer=timer)
    assert policy.log == [
        ("offload_before_refit",),
        ("generation.prepare_for_generation", ["weights"]),
        ("stream_weights_via_http", ("http://h:1", "http://h:2"), GIB // 2),
        ("gather", 2),
        ("offload_after_refit",),
        ("generation.prepare_for_generation", ["kv_cache"]),
    ]
    assert not sync.is_stale
    assert timer.reduce("prepare_for_generation/transfer_and_update_weights", "count") == 1
    assert metrics == {"http_bytes_sent": 140.0, "http_buckets": 5.0, "http_transfer_s": 0.5}
    assert all(isinstance(v, float) for v in metrics.values())  # NeMo RL logs them as scalars under refit/


def test_failed_transfer_restores_both_sides_and_is_stale_again():
    policy, _, sync = _pair(refit_buffer_size_gb=1)
    sync.sync_weights()
    assert not sync.is_stale
    policy.client.fail = True
    del policy.log[:]
    with pytest.raises(RuntimeError, match="injected"):  # RefitError is NeMo RL's RuntimeError on failure
        sync.sync_weights()
    assert policy.log[-2:] == [("offload_after_refit",), ("generation.prepare_for_generation", ["kv_cache"])]
    assert sync.is_stale  # the engines may hold a mix of old and new weights


def test_not_colocated_only_moves_weights():
    policy = _Policy()
    engines = _Engines(policy.log, ["http://h:1"])
    sync = create_weight_synchronizer(policy, engines, "sglang", False, refit_buffer_size_gb=1)
    sync.sync_weights()
    assert [c[0] for c in policy.log] == ["stream_weights_via_http", "gather"]


def test_buffer_size_follows_nemo_rls_rule(monkeypatch):
    monkeypatch.delenv("NRL_REFIT_BUFFER_MEMORY_RATIO", raising=False)
    policy, _, sync = _pair()
    sync.sync_weights()  # nothing configured: the Policy's own rule (its refit_buffer_size_gb, else 0.3 x free)
    assert ("stream_weights_via_http", ("http://h:1", "http://h:2"), None) in policy.log
    monkeypatch.setenv("NRL_REFIT_BUFFER_MEMORY_RATIO", "0.25")
    policy, _, sync = _pair()
    sync.sync_weights()
    assert ("stream_weights_via_http", ("http://h:1", "http://h:2"), 250 * GIB) in policy.log
    policy, _, sync = _pair(refit_buffer_size_gb=2)  # a configured size wins over the ratio
    sync.sync_weights()
    assert ("stream_weights_via_http", ("http://h:1", "http://h:2"), 2 * GIB) in policy.log
    monkeypatch.setenv("NRL_REFIT_BUFFER_MEMORY_RATIO", "0")
    with pytest.raises(ValueError, match="NRL_REFIT_BUFFER_MEMORY_RATIO must be > 0"):
        _pair()[2].sync_weights()


def test_engines_from_a_policys_nemo_rl_shaped_sglang_cfg():
    # NeMo RL reads the TP size from generation.sglang_cfg.sglang_server_config.num_gpus_per_engine
    # (nemo_rl/models/generation/sglang/sglang_generation.py:91-97)
    from types import SimpleNamespace

    sglang_cfg = {
        "server_urls": ["http://a:1", "http://b:2/"],
        "sglang_server_config": {"num_gpus_per_engine": 2, "num_gpus": 4, "needs_offload": True},
    }
    cfg = dask_lm.PolicyConfig.from_dict(
        {"model_name": "m", "generation": {"backend": "sglang", "max_new_tokens": 8, "sglang_cfg": sglang_cfg}}
    )
    engines = SGLangEngines.from_policy(SimpleNamespace(cfg=cfg))
    assert engines.get_rollout_engine_urls() == ["http://a:1", "http://b:2"] and engines.num_gpus_per_engine == 2
    with pytest.raises(ValueError, match=r"sglang_cfg.server_urls"):
        SGLangEngines.from_policy(SimpleNamespace(cfg=dask_lm.PolicyConfig.from_dict({"model_name": "m"})))


def test_refusals():
    policy = _Policy()
    engines = SGLangEngines(["http://h:1"])
    with pytest.raises(ValueError, match="Unknown generation backend 'trtllm'"):
        create_weight_synchronizer(policy, engines, "trtllm", True)
    with pytest.raises(NotImplementedError, match="stream_weights_via_ipc_zmq"):
        create_weight_synchronizer(policy, engines, "vllm", True)
    with pytest.raises(ValueError, match="refit_buffer_size_gb"):
        create_weight_synchronizer(policy, engines, "sglang", True, refit_buffer_size_gb=0)
    with pytest.raises(ValueError, match="SGLangEngines"):
        create_weight_synchronizer(policy, object(), "sglang", True)
    with pytest.raises(ValueError, match=r"rollout_engine_urls\[0\]"):
        SGLangEngines(["h:1"])
    sync = create_weight_synchronizer(policy, engines, "sglang", True)
    with pytest.raises(ValueError, match="kv_scales"):
        sync.sync_weights(kv_scales={"layer.0": 1.0})
    assert policy.log == []  # refused before any phase change
    sync.shutdown()
    with pytest.raises(ValueError, match="after shutdown"):
        sync.sync_weights()


# ----------------------------------------------------------------------------------------- against a server
def _sha(t):
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _server_holds(server, weights):
    shas = server.state_dict_sha()
    return {n: _sha(t) for n, t in weights.items()} == {n: shas[n] for n in weights}


@pytest.fixture(scope="module")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny["llama"])


@pytest.fixture(scope="module")
def policy(client, tiny, tok):
    cfg = {
        "model_name": tiny["llama"],
        "precision": "float32",
        "train_global_batch_size": 4,
        "train_micro_batch_size": 2,
        "max_total_sequence_length": 128,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}},
    }
    p = dask_lm.Policy(client, cfg, tok)
    yield p
    p.shutdown()


def _train_step(policy, tok, texts):
    policy.prepare_for_training()  # where NeMo RL's GRPO marks the generation stale (grpo.py:3328-3329)
    policy.train(sft_batch(tok, texts), dask_lm.NLLLoss())


@pytest.mark.cluster
def test_grpo_call_sequence_refits_the_trained_weights(policy, tiny, tok, tmp_path):
    with start_server(tiny["llama"]) as server:
        engines = SGLangEngines([server.url])
        sync = create_weight_synchronizer(policy, engines, "sglang", True, refit_buffer_size_gb=BUFFER_GB)
        sync.init_communicator()
        assert engines.refit_info == policy.prepare_refit_info()
        assert sync.is_stale
        _train_step(policy, tok, TEXTS[:4])
        assert sync.is_stale  # no sync yet
        metrics = sync.sync_weights(timer=dask_lm.Timer())
        assert not sync.is_stale
        trained = saved_weights(policy, tmp_path / "step1")
        assert _server_holds(server, trained)  # bit for bit what the trained policy's checkpoint holds
        st = server.state()
        assert st["sessions_begun"] == st["sessions_ended"] == 1 and not st["session_open"]
        assert metrics["http_buckets"] == len(st["updates"]) > 3
        # the server answers with the policy's logprobs
        ids, lens = make_batch(tok, TEXTS)
        want = policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))["logprobs"]
        torch.testing.assert_close(server.logprobs(ids, lens), want, rtol=0, atol=1e-5)

        # another step: the engines are behind, and (NeMo RL's meaning) is_stale does not say so: the loop tracks it
        _train_step(policy, tok, TEXTS[1:5])
        step2 = saved_weights(policy, tmp_path / "step2")
        assert not _server_holds(server, step2) and not sync.is_stale
        sync.sync_weights()
        assert _server_holds(server, step2)
        assert server.state()["sessions_begun"] == 2
        flushes = server.state()["flushes"]
        assert engines.invalidate_kv_cache() and server.state()["flushes"] == flushes + 1
        sync.shutdown()


@pytest.mark.cluster
def test_refused_update_raises_and_leaves_the_synchronizer_stale(policy, tiny, tok):
    with start_server(tiny["llama"], extra_args=["--fail-update", "2"]) as server:
        sync = create_weight_synchronizer(
            policy, SGLangEngines([server.url]), "sglang", True, refit_buffer_size_gb=BUFFER_GB
        )
        sync.init_communicator()
        with pytest.raises(RuntimeError, match="injected failure on bucket 2"):
            sync.sync_weights()
        assert sync.is_stale
        st = server.state()
        assert st["sessions_begun"] == st["sessions_ended"] == 1 and not st["session_open"]
        sync.sync_weights()  # the next refit goes through
        assert not sync.is_stale
