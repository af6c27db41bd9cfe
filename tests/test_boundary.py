"""The driver -> rank boundary: the public surface is frozen, every request type has exactly one endpoint, the
messages are immutable, and the driver's modules import no rank code."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import typing

import pytest

import dask_lm
from dask_lm.data import messages

# `dask_lm.__all__` and the parameters of every public Policy method, as of the last release before the boundary
# was redesigned (taken from that commit, c2cef96): a change here is a change of the public API, made on purpose
PUBLIC_NAMES = [
    "BatchError",
    "BatchedDataDict",
    "ClippedPGLossConfig",
    "ClippedPGLossFn",
    "DPOLossConfig",
    "DPOLossFn",
    "DistillationLossConfig",
    "DistillationLossFn",
    "DynamicBatchingArgs",
    "FLOPTracker",
    "LossFunction",
    "LossInputType",
    "LossType",
    "NLLLoss",
    "NLLLossFn",
    "PackingAlgorithm",
    "Policy",
    "PolicyConfig",
    "PreferenceLossFn",
    "RankFailedError",
    "RefitError",
    "ScoreResult",
    "SequencePackingArgs",
    "SlicedDataDict",
    "Timer",
    "WorkerLostError",
    "__version__",
    "calculate_kl",
    "connect",
    "get_packer",
    "masked_mean",
    "prepare_loss_input",
    "score_parquet",
    "set_progress",
    # added since, on purpose: the demo's model and data (issue 27), reading a scoring output back
    "demo_data",
    "demo_model",
    "read_scores",
    # issue 28: a Dask (or pandas) DataFrame scored in memory, a lazy Dask DataFrame back
    "score",
    # issue 28: the future of a Policy call (Policy.submit)
    "PolicyFuture",
]
POLICY_SIGNATURES = {
    "broadcast_weights_for_collective": "(self, kv_scales=None, *, buffer_size_bytes=None, num_buffers=None)",
    "finalize_async_save": "(self)",
    "finish_generation": "(self, *args, **kwargs)",
    "finish_inference": "(self)",
    "finish_training": "(self, *args, **kwargs)",
    "generate": "(self, data, greedy=False, seed=None)",
    "get_free_memory_bytes": "(self)",
    "get_logprobs": "(self, data, timer=None)",
    "get_reference_policy_logprobs": "(self, data, micro_batch_size=None, timer=None)",
    "get_topk_logits": "(self, data, k, micro_batch_size=None, timer=None)",
    "get_zmq_addresses": "(self)",
    "init_collective": "(self, ip, port, world_size, *, train_world_size, timeout_s=None)",
    "invalidate_kv_cache": "(self, *args, **kwargs)",
    "offload_after_refit": "(self)",
    "offload_before_refit": "(self)",
    "offload_to_cpu": "(self)",
    "prepare_for_generation": "(self, *args, **kwargs)",
    "prepare_for_lp_inference": "(self, keep_train_buffers=False)",
    "prepare_for_training": "(self, *args, **kwargs)",
    "prepare_refit_info": "(self)",
    "print_node_ip_and_gpu_id": "(self)",
    "report_device_id": "(self)",
    "run_all_workers_multiple_data": (
        "(self, method_name, *args, run_rank_0_only_axes=None, common_kwargs=None, **kwargs)"
    ),
    "run_all_workers_single_data": "(self, method_name, *args, run_rank_0_only_axes=None, **kwargs)",
    "save_checkpoint": "(self, weights_path, optimizer_path=None, tokenizer_path=None, checkpointing_cfg=None)",
    "score": "(self, data)",
    "set_rollout_num_gpus_per_engine": "(self, num_gpus_per_engine)",
    "shutdown": "(self)",
    "start_gpu_profiling": "(self)",
    "stop_gpu_profiling": "(self)",
    "submit": "(self, method, /, *args, collect=True, **kwargs)",
    "stream_weights_via_http": (
        "(self, rollout_engine_urls, buffer_size_bytes=None, *, weight_version=None, timeout_s=600.0, transport=None)"
    ),
    "stream_weights_via_ipc_zmq": "(self, buffer_size_bytes=None, kv_scales=None, *, timeout_s=120.0)",
    "train": "(self, data, loss_fn, eval_mode=False, gbs=None, mbs=None, timer=None, check_dim_skip_keys=None)",
    # issue 30: NeMo RL's full-logit IPC for cross-tokenizer distillation, and its NVSHMEM hook (a no-op here)
    "get_full_logits_ipc": "(self, data, micro_batch_size=None, timer=None)",
    "release_ipc_buffer": "(self)",
    "preinit_nvshmem": "(self)",
    # issue 30: NeMo RL's resharded refit, each inference rank getting only its slices of the FSDP shards
    "init_nccl_reshard_comm_group": "(self, pp_ips, pp_ports, pp_size, pp_stages, sub_world_size, ranks_in_group)",
    "prepare_nccl_reshard_refit_info": "(self, train_parallelism, gen_parallelism, train_world_size, gen_world_size)",
    "nccl_reshard_refit": "(self, kv_scales=None)",
    # issue 30: weights between two Policies of one cluster over a shared refit group
    "init_collective_mcore_generation": "(self, ip, port, world_size, *, rank_offset, refit_backend='gloo')",
    "calibrate_qkv_fp8_scales": "(self, data, micro_batch_size=None, percentile=99.9, margin=1.05, include_q=False)",
    "swap_weights_via_reshard": "(self, *, is_source)",
    # `workers` (issue 30, a dask-lm addition after NeMo RL's parameters): which workers, so two Policies can run
    # side by side on different workers of one cluster
    "__init__": (
        "(self, cluster, config, tokenizer, name_prefix='lm_policy', workers_per_node=None, "
        "init_optimizer=True, weights_path=None, optimizer_path=None, init_reference_model=True, "
        "processor=None, worker_extension_cls_fqn=None, skip_weight_load=False, workers=None)"
    ),
}
POLICY_PROPERTIES = ["data_parallel_size", "group"]


def _bare(fn: typing.Any) -> str:
    sig = inspect.signature(fn)
    return str(
        sig.replace(
            parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
            return_annotation=inspect.Signature.empty,
        )
    )


def test_public_names_are_frozen():
    assert sorted(dask_lm.__all__) == sorted(PUBLIC_NAMES)


def test_policy_signatures_are_frozen():
    from dask_lm import Policy

    public = {n for n in dir(Policy) if not n.startswith("_")}
    methods = {n for n in public if callable(getattr(Policy, n))}
    assert methods | {"__init__"} == set(POLICY_SIGNATURES)
    assert sorted(public - methods) == POLICY_PROPERTIES
    for name, want in POLICY_SIGNATURES.items():
        assert _bare(getattr(Policy, name)) == want, name


# NeMo RL's Policy methods (nemo_rl/models/policy/lm_policy.py at NVIDIA-NeMo/RL 7ea279a, 2026-08-22), and those
# dask-lm does not have yet (issue 30): the set shrinks as they land, and a method that lands must leave it
NEMO_RL_POLICY_METHODS = {
    "broadcast_weights_for_collective",
    "calibrate_qkv_fp8_scales",
    "finalize_async_save",
    "finish_generation",
    "finish_inference",
    "finish_training",
    "generate",
    "get_free_memory_bytes",
    "get_full_logits_ipc",
    "get_logprobs",
    "get_reference_policy_logprobs",
    "get_topk_logits",
    "init_collective",
    "init_collective_mcore_generation",
    "init_nccl_reshard_comm_group",
    "invalidate_kv_cache",
    "nccl_reshard_refit",
    "offload_after_refit",
    "offload_before_refit",
    "offload_to_cpu",
    "preinit_nvshmem",
    "prepare_for_generation",
    "prepare_for_lp_inference",
    "prepare_for_training",
    "prepare_nccl_reshard_refit_info",
    "prepare_refit_info",
    "print_node_ip_and_gpu_id",
    "release_ipc_buffer",
    "run_all_workers_multiple_data",
    "run_all_workers_single_data",
    "save_checkpoint",
    "score",
    "set_rollout_num_gpus_per_engine",
    "shutdown",
    "start_gpu_profiling",
    "stop_gpu_profiling",
    "stream_weights_via_http",
    "stream_weights_via_ipc_zmq",
    "swap_weights_via_reshard",
    "train",
}
NOT_YET: set[str] = set()


def test_nemo_rl_policy_methods_are_all_there_but_the_listed_ones():
    from dask_lm import Policy

    have = {n for n in dir(Policy) if not n.startswith("_")}
    assert sorted(NEMO_RL_POLICY_METHODS - NOT_YET - have) == []
    assert sorted(NOT_YET & have) == []  # landed: take it off NOT_YET


def test_every_request_type_has_one_endpoint():
    from dask_lm.workers.endpoints import ENDPOINTS

    requests = set(typing.get_args(messages.Request))
    assert requests and set(ENDPOINTS) == requests


MESSAGE_CLASSES = [n for n in messages.__all__ if dataclasses.is_dataclass(getattr(messages, n))]


def test_every_request_is_a_message_class():
    assert set(typing.get_args(messages.Request)) <= {getattr(messages, n) for n in MESSAGE_CLASSES}


@pytest.mark.parametrize("name", MESSAGE_CLASSES)
def test_messages_are_frozen_and_slotted(name):
    cls = getattr(messages, name)
    assert cls.__dataclass_params__.frozen, name
    assert "__slots__" in vars(cls), name


def test_messages_travel_through_dasks_serializers_not_whole_pickles():
    """A message's tensors and Arrow table go as Dask's own frames (a pickled tensor would go through torch.save);
    what arrives equals what was sent."""
    import torch
    from distributed.protocol.serialize import deserialize, serialize

    out = messages.ForwardOutput({"logprobs": torch.randn(64, 32), "topk_indices": torch.arange(12).view(3, 4)})
    header, frames = serialize(out, serializers=("dask", "pickle"), on_error="raise")
    assert header["serializer"] == "dask"
    back = deserialize(header, frames)
    assert type(back) is messages.ForwardOutput and back.tensors.keys() == out.tensors.keys()
    for key, value in out.tensors.items():
        torch.testing.assert_close(back.tensors[key], value, rtol=0, atol=0)
    batch = dask_lm.BatchedDataDict(input_ids=torch.tensor([[5, 6, 7], [8, 9, 0]]), input_lengths=torch.tensor([3, 2]))
    request = messages.TrainRequest(
        messages.Shard.of(batch, packed=False),
        dask_lm.NLLLoss(),
        eval_mode=True,
        gbs=2,
        mbs=1,
        num_global_batches=1,
        progress_id="p",
    )
    header, frames = serialize(request, serializers=("dask", "pickle"), on_error="raise")
    assert header["serializer"] == "dask"
    back = deserialize(header, frames)
    assert (back.eval_mode, back.gbs, back.mbs, back.num_global_batches, back.progress_id) == (True, 2, 1, 1, "p")
    assert type(back.loss_fn) is dask_lm.NLLLoss and back.shard.plan == request.shard.plan
    torch.testing.assert_close(back.shard.rows()["input_ids"], batch["input_ids"], rtol=0, atol=0)


def test_a_shard_round_trips_its_rows_and_plan():
    import torch

    batch = dask_lm.BatchedDataDict(
        input_ids=torch.tensor([[5, 6, 7], [8, 9, 0]]),
        input_lengths=torch.tensor([3, 2]),
        advantages=torch.tensor([0.5, -1.0]),
    )
    batch.micro_batch_indices = [[[0, 1], [1, 2]]]
    batch.micro_batch_lengths = [[3, 2]]
    shard = messages.Shard.of(batch, packed=True)
    assert shard.plan == messages.MicroBatchPlan(
        packed=True, micro_batch_indices=[[[0, 1], [1, 2]]], micro_batch_lengths=[[3, 2]]
    )
    rows = shard.rows()
    for key in batch:
        torch.testing.assert_close(rows[key], batch[key], rtol=0, atol=0)
    # the layout lives once, in the plan the rank reads; the rows are data only
    assert rows.micro_batch_indices is None and rows.elem_counts_per_gb is None
    assert shard.plan.global_batch(0, rows=2) == (0, 2, [[[0, 1], [1, 2]]])


class _Extension:
    def whoami(self) -> str:
        return "me"


def test_extension_calls_reach_only_the_extension_and_the_allow_list():
    from dask_lm.workers.endpoints import EXTENSION_BASE_METHODS, handle
    from dask_lm.workers.policy_worker import PolicyWorker

    worker = object.__new__(type("_ExtensionPolicyWorker", (_Extension, PolicyWorker), {}))
    assert handle(worker, messages.ExtensionCall("whoami")) == "me"
    assert "report_device_id" in EXTENSION_BASE_METHODS
    for name in ("get_logprobs", "train", "load_weights", "_forward", "__init__", "shutdown"):
        with pytest.raises(ValueError, match="worker_extension_cls_fqn"):
            handle(worker, messages.ExtensionCall(name))
    with pytest.raises(TypeError, match="no endpoint"):
        handle(worker, object())


def test_the_driver_imports_no_rank_code():
    """The driver's modules (Policy, the batch jobs, the command, the lm-eval engine) import of the rank side
    (workers, model, comm, refit, and the rank halves of scoring and lm-eval) only the task entry points, the lease,
    the plugin state, the watchdog's ``Client.run`` probe (workers.occupancy, stdlib only) and refit's driver half:
    everything a rank runs is imported on the rank."""
    code = """
import sys
import dask_lm.cli, dask_lm.engine.policy, dask_lm.scoring.job, dask_lm.sft.job, dask_lm.evaluation.engine
print(sorted(m for m in sys.modules if m.startswith(("dask_lm.workers.", "dask_lm.model.", "dask_lm.comm.",
                                                     "dask_lm.refit.", "dask_lm.scoring.scorer",
                                                     "dask_lm.scoring.replicas", "dask_lm.scoring.partitions",
                                                     "dask_lm.evaluation.requests"))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = set(eval(out.stdout.strip().splitlines()[-1]))
    assert loaded <= {
        "dask_lm.workers.tasks",
        "dask_lm.workers.lease",
        "dask_lm.workers.state",
        "dask_lm.workers.occupancy",
        "dask_lm.refit.driver",
    }, sorted(loaded)
