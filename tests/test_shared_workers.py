"""Policies that share workers: their calls run in one order on every worker (no deadlock, no failure passed on),
and a driver that lost its scheduler says so.

The first tests drive two real ``WorkerGroup``s with trivial rank functions on an in-process cluster of
single-threaded workers (no model, no worker processes), where a "collective" is a meeting of the call's ranks
through ``distributed.Event``s; the cluster test runs two real Policies on the session's 2 worker processes against
single-process Hugging Face. Every wait is bounded, so a regression fails within its bound instead of hanging.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid

import dask
import pytest
import torch
import transformers
from distributed import Client, Event, LocalCluster, get_worker, wait
from helpers import TEXTS, hf_logprobs, hf_nll_steps, model_logprobs, sft_batch

import dask_lm
from dask_lm import BatchedDataDict, RankFailedError, WorkerLostError
from dask_lm.engine.worker_group import WorkerGroup

# a bound for each blocking wait of the fast tier: a deadlock shows as a failure within it
BOUND_S = 30


@pytest.fixture()
def single_threaded():
    """Three workers of one thread each (a GPU worker's setting): a task running on a worker keeps the next one out."""
    with (
        LocalCluster(n_workers=3, threads_per_worker=1, processes=False, dashboard_address=":0") as cl,
        Client(cl) as c,
    ):
        yield cl, c


# each rank function takes the rank's previous chained result first, as WorkerGroup.submit passes it
FINISHED: dict[str, list[str]] = {}  # worker name -> the calls that finished there, in order (in-process workers)
_finished_lock = threading.Lock()


def meet(prev, call, rank, world, *_deps, bound=BOUND_S):
    """A collective in miniature: announce this rank of ``call``, wait (up to ``bound`` s, its collective timeout)
    until every rank of it has."""
    Event(f"{call}-r{rank}").set()
    for peer in range(world):
        if not Event(f"{call}-r{peer}").wait(bound):
            raise RuntimeError(f"rank {rank} of {call} waited {bound} s for rank {peer}: deadlocked")
    with _finished_lock:
        FINISHED.setdefault(str(get_worker().name), []).append(call)
    return {"call": call, "worker": get_worker().name}


def held(event):
    assert Event(event).wait(BOUND_S), "the test never released the held input"
    return "input"


def fail(prev, call, *_deps):
    with _finished_lock:
        FINISHED.setdefault(str(get_worker().name), []).append(call)
    raise RuntimeError(f"{call} failed on worker {get_worker().name}")


def _rank1_waits(dask_scheduler, policy_id):
    """A rank-1 task of ``policy_id`` waits on the scheduler for a dependency."""
    return any(
        ts.state == "waiting" for k, ts in dask_scheduler.tasks.items() if policy_id in str(k) and "-r1-" in str(k)
    )


def _poll(condition, what):
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("b_calls", ["submit", "blocking call from another thread"])
def test_two_groups_on_the_same_workers_run_their_calls_in_one_order(single_threaded, b_calls):
    """Worker 0 starts group A's call, whose rank 1 waits for an input; group B's call comes next (a future, or a
    blocking call in a second driver thread). Unordered, worker 1 (idle) starts B's rank 1, which waits for B's
    rank 0, queued on worker 0 behind A's rank 0, which waits for A's rank 1, queued behind B's: a deadlock until
    the collective times out. Ordered, B's rank 1 waits for A's, both calls finish, and each worker ran A's call
    before B's."""
    _cluster, client = single_threaded
    a, b = WorkerGroup(client, workers=[0, 1]), WorkerGroup(client, workers=[0, 1])
    try:
        tag = uuid.uuid4().hex[:6]
        call_a, call_b, hold = f"a-{tag}", f"b-{tag}", f"hold-{tag}"
        late_input = client.submit(held, hold, workers=[2], pure=False)  # on a worker of neither group
        fa = a.submit(meet, call_a, per_rank=[(0, 2), (1, 2, late_input)], key_name="a")
        answer: dict[str, object] = {}
        if b_calls == "submit":
            fb = b.submit(meet, call_b, per_rank=[(0, 2), (1, 2)], key_name="b")
        else:

            def blocking_b():
                try:
                    answer["out"] = b.call(meet, call_b, per_rank=[(0, 2), (1, 2)], key_name="b", what="call B")
                except BaseException as e:  # raised again in the test's thread
                    answer["error"] = e

            thread = threading.Thread(target=blocking_b)
            thread.start()

        def b_rank1_started_or_waits():
            # unordered, B's rank 1 starts at once on idle worker 1; ordered, it waits on the scheduler for A's
            if Event(f"{call_b}-r1").is_set():
                return True
            return client.run_on_scheduler(_rank1_waits, policy_id=b.policy_id)

        _poll(b_rank1_started_or_waits, "group B's rank 1 neither started nor waited")
        Event(hold).set()
        out_a = a.gather(fa, what="call A", timeout=3 * BOUND_S)
        if b_calls == "submit":
            out_b = b.gather(fb, what="call B", timeout=3 * BOUND_S)
        else:
            thread.join(4 * BOUND_S)
            assert not thread.is_alive(), "B's blocking call did not return"
            if "error" in answer:
                raise answer["error"]
            out_b = answer["out"]
        assert [o["worker"] for o in out_a] == [o["worker"] for o in out_b] == [0, 1]
        for worker in ("0", "1"):
            mine = [c for c in FINISHED[worker] if c.endswith(tag)]
            assert mine == [call_a, call_b], (worker, mine)
    finally:
        a.release_lease()
        b.release_lease()


def test_a_failed_call_of_one_group_neither_fails_nor_jumps_the_next_call_of_another(single_threaded):
    """Group A's call waits for an input, then fails on both ranks; group B's call, submitted after it, runs after
    it on each worker (unordered, B's ranks would run first, their workers being idle) and finishes: A's failure is
    A's alone, though B's tasks follow A's (Dask fails a task whose dependency failed)."""
    _cluster, client = single_threaded
    a, b = WorkerGroup(client, workers=[0, 1]), WorkerGroup(client, workers=[0, 1])
    try:
        tag = uuid.uuid4().hex[:6]
        call_a, call_b, hold = f"a-{tag}", f"b-{tag}", f"hold-{tag}"
        late_input = client.submit(held, hold, workers=[2], pure=False)
        fa = a.submit(fail, call_a, late_input, key_name="a")
        fb = b.submit(meet, call_b, per_rank=[(0, 2), (1, 2)], key_name="b")
        Event(hold).set()
        # both ranks fail: the error names whichever failure reached the driver first
        with pytest.raises(
            RankFailedError,
            match=f"^call A failed on rank ([01]) \\(worker \\1\\): RuntimeError: {call_a} failed on worker \\1$",
        ):
            a.gather(fa, what="call A", timeout=3 * BOUND_S)
        assert [o["call"] for o in b.gather(fb, what="call B", timeout=3 * BOUND_S)] == [call_b, call_b]
        for worker in ("0", "1"):
            assert [c for c in FINISHED[worker] if c.endswith(tag)] == [call_a, call_b], worker
        assert a.broken is None and b.broken is None
    finally:
        a.release_lease()
        b.release_lease()


def test_policies_of_two_clients_that_deadlock_are_named_long_before_the_collective_timeout(
    single_threaded, monkeypatch
):
    """Two groups made through two clients are not ordered: forced into the deadlock above, each call fails after a
    few of its settle slices (not after its collective timeout) with an error naming both Policies and the fix,
    and leaves its group broken. (Slices of 1 s instead of 5: the same checks, sooner.)"""
    monkeypatch.setattr("dask_lm.engine.worker_group.SETTLE_SLICE_S", 1.0)
    cluster, client = single_threaded
    with Client(cluster) as other:
        a, b = WorkerGroup(client, workers=[0, 1]), WorkerGroup(other, workers=[0, 1])
        tag = uuid.uuid4().hex[:6]
        call_a, call_b, hold = f"a-{tag}", f"b-{tag}", f"hold-{tag}"
        try:
            late_input = client.submit(held, hold, workers=[2], pure=False)
            fa = a.submit(meet, call_a, per_rank=[(0, 2), (1, 2, late_input)], key_name="a", bound=4 * BOUND_S)
            # B is submitted only once A's rank 0 holds worker 0: else, on a busy machine, B's rank 0 could take
            # worker 0 first, and B would finish before A without any deadlock to name
            _poll(lambda: Event(f"{call_a}-r0").is_set(), "group A's rank 0 never started")
            fb = b.submit(meet, call_b, per_rank=[(0, 2), (1, 2)], key_name="b", bound=4 * BOUND_S)
            _poll(lambda: Event(f"{call_b}-r1").is_set(), "group B's rank 1 never started")
            Event(hold).set()
            for group, futures, me, peer in ((a, fa, "call A", b), (b, fb, "call B", a)):
                expected = (
                    f"^{me} of policy {group.policy_id} is deadlocked with policy {peer.policy_id} on the "
                    "same workers: .* create them with the same Client"
                )
                with pytest.raises(RankFailedError, match=expected):
                    group.gather(futures, what=me, timeout=3 * BOUND_S)
                assert str(group.broken).startswith(f"{me} of policy {group.policy_id} is deadlocked")
        finally:
            for event in (f"{call_a}-r1", f"{call_b}-r0", hold):  # the "collectives" end: the workers are free
                Event(event).set()
            a.release_lease()
            b.release_lease()


# ------------------------------------------------------------------------------------------- a lost scheduler


@pytest.fixture(scope="module")
def tok(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny["llama"])


def _cfg(model_dir, **extra):
    cfg = {
        "model_name": model_dir,
        "precision": "float32",
        "train_global_batch_size": 8,
        "train_micro_batch_size": 2,
        "logprob_batch_size": 2,
        "max_total_sequence_length": 128,
        "max_grad_norm": 1.0,
        "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}},
    }
    cfg.update(extra)
    return cfg


def test_a_lost_scheduler_is_a_worker_lost_error_naming_it(tiny, tok):
    """The scheduler stops while a Policy's futures are out; once the client has given up reconnecting, their
    ``.result()`` and every later call raise WorkerLostError (the cluster is gone for this driver) naming the
    scheduler and the fix, not Dask's "ValueError: No clients found" (ValueError means bad input here)."""
    batch = sft_batch(tok, TEXTS)
    fwd = BatchedDataDict(input_ids=batch["input_ids"], input_lengths=batch["input_lengths"])
    cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0")
    # gives up reconnecting after 3 s (30 s by default)
    client = Client(cluster, timeout=3)
    try:
        address = cluster.scheduler.address
        policy = dask_lm.Policy(client, _cfg(tiny["llama"]), tok)
        futures = [policy.submit("get_logprobs", fwd) for _ in range(2)]
        cluster.sync(cluster.scheduler.close)
        _poll(lambda: client.status == "closed", "the client never gave up on its scheduler")
        expected = f"lost its connection to the scheduler at {address}"
        for fut in futures:
            with pytest.raises(WorkerLostError, match=expected) as info:
                fut.result()
            assert "create a new Policy" in str(info.value)
        with pytest.raises(WorkerLostError, match=expected):
            policy.get_logprobs(fwd)
    finally:
        with contextlib.suppress(Exception):
            client.close()
        # closing asks the stopped scheduler to terminate: a connect attempt that would wait the default 30 s
        with contextlib.suppress(Exception), dask.config.set({"distributed.comm.timeouts.connect": "2s"}):
            cluster.close()


# ------------------------------------------------------------------------------------------- two Policies

# a wait bound for the Policies' futures: unordered, they deadlock until the collective timeout (below), so a
# regression fails here rather than after 600 s, and leaves the session's workers free soon after
FUTURE_BOUND_S = 180
CORPUS = TEXTS + ["Tokens flow through the cluster.", "Every rank runs the same steps.", "Short one."]  # a global batch


@pytest.mark.cluster
def test_two_policies_on_the_same_workers_finish_interleaved_calls_as_each_would_alone(client, tiny, tok):
    """A policy and a second policy (another model) on the same 2 workers, with their train steps (4 each) and
    logprob calls submitted interleaved: every future finishes, and each Policy's losses and logprobs equal
    single-process Hugging Face running that model alone."""
    batch = sft_batch(tok, CORPUS)
    fwd = BatchedDataDict(input_ids=batch["input_ids"], input_lengths=batch["input_lengths"])
    models = {"a": tiny["llama"], "b": tiny["llama_tuned"]}
    steps = [(batch["input_ids"], batch["input_lengths"], batch["token_mask"], batch["sample_mask"])] * 4
    want = {}
    for name, path in models.items():
        losses, _, trained = hf_nll_steps(path, steps, lr=0.5, max_grad_norm=1.0)
        before, _ = hf_logprobs(path, fwd["input_ids"], fwd["input_lengths"])
        want[name] = (losses, before, model_logprobs(trained, fwd["input_ids"], fwd["input_lengths"]))
    cfg = {"collective_timeout_s": FUTURE_BOUND_S - 30}
    with (
        dask_lm.Policy(client, _cfg(models["a"], **cfg), tok) as pa,
        dask_lm.Policy(client, _cfg(models["b"], **cfg), tok) as pb,
    ):
        policies = {"a": pa, "b": pb}
        assert pa.group.names == pb.group.names == [0, 1]
        futures = {name: {"before": p.submit("get_logprobs", fwd), "train": []} for name, p in policies.items()}
        for _ in range(4):
            for name, p in policies.items():
                futures[name]["train"].append(p.submit("train", batch, dask_lm.NLLLoss()))
        for name, p in policies.items():
            futures[name]["after"] = p.submit("get_logprobs", fwd)
        every = [f for calls in futures.values() for f in (calls["before"], *calls["train"], calls["after"])]
        _done, pending = wait(every, timeout=FUTURE_BOUND_S)
        assert not pending, f"{len(pending)} of {len(every)} futures did not finish: the Policies deadlocked"
        for name in policies:
            losses, before, after = want[name]
            got = [float(f.result()["loss"][0]) for f in futures[name]["train"]]
            assert got == pytest.approx(losses, abs=1e-5), name
            torch.testing.assert_close(futures[name]["before"].result()["logprobs"], before, atol=1e-4, rtol=0)
            torch.testing.assert_close(futures[name]["after"].result()["logprobs"], after, atol=1e-4, rtol=0)
