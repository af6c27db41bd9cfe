"""The fast tier of ``WorkerGroup`` orchestration: gather, the broken group, the rank chain and a lost worker.

No model and no torch work: trivial rank functions on an in-process ``LocalCluster`` (``processes=False``, worker
threads in this process), driven through the real ``WorkerGroup`` with its real worker plugin and lease. Each test
compares with what ``dask_lm/engine/worker_group.py`` documents. Ranks are held mid-call with
``distributed.Event`` (the blocked-handler pattern of ``distributed.utils_test``, for a running task), so an order
is forced by events, never hoped for after a sleep. No ``cluster`` marker: this tier starts no worker processes.
"""

from __future__ import annotations

import uuid
import warnings

import pytest
from distributed import Client, Event, LocalCluster, get_worker, wait

from dask_lm import RankFailedError, WorkerLostError, interface
from dask_lm.engine.worker_group import WorkerGroup
from dask_lm.errors import PeerFailedError

# a bound for each blocking call of a test: a bug shows as a failure within it, never as a hung run
BOUND_S = 20


@pytest.fixture(scope="module")
def cluster():
    # two threads per worker: a rank held mid-call leaves room for an unchained task beside it
    with LocalCluster(n_workers=3, threads_per_worker=2, processes=False, dashboard_address=":0") as cl:
        yield cl


@pytest.fixture()
def client(cluster):
    # shadows conftest's `client` (a cluster of worker processes): this module never starts one
    with Client(cluster) as c:
        yield c


@pytest.fixture()
def events():
    """Fresh cluster-wide events; every one is set when the test ends, so no rank stays held into the next test."""
    made = []

    def make():
        ev = Event(f"orchestration-{uuid.uuid4().hex}")
        made.append(ev)
        return ev

    yield make
    for ev in made:
        ev.set()


@pytest.fixture()
def group(client):
    g = WorkerGroup(client)
    yield g
    g.release_lease()


# ---------------------------------------------------------------------------------------- rank functions
# each takes the rank's previous chained result first, as WorkerGroup.submit passes it


def whoami(prev, tag=None):
    return {"worker": get_worker().name, "prev": prev, "tag": tag}


def wait_then_whoami(prev, hold, tag=None):
    """Held until ``hold`` (an Event's name) is set: forces this rank to finish after its peers."""
    assert Event(hold).wait(BOUND_S), "the test never released this rank"
    return whoami(prev, tag)


def set_then_whoami(prev, release, tag=None):
    """Sets ``release`` (an Event's name) once its result is ready: its peers may go on."""
    out = whoami(prev, tag)
    Event(release).set()
    return out


def fail(prev, kind="runtime"):
    if kind == "value":
        raise ValueError("bad input on this rank")
    if kind == "peer":
        raise PeerFailedError("a peer failed")
    raise RuntimeError(f"boom on worker {get_worker().name}")


def warn_once(prev):
    return interface.Warned(get_worker().name, ((UserWarning, "the same warning from every rank"),))


def peer_gone(prev, notice):
    """A rank in a collective whose peer's worker died: it fails when the transport notices (``notice`` set)."""
    assert Event(notice).wait(BOUND_S), "the test never said the peer was gone"
    raise RuntimeError("Connection closed by peer")


# ---------------------------------------------------------------------------------------- (a) gather


def relay(prev, hold, release):
    """Waits for ``hold`` (when given), then sets ``release`` (when given): chains the ranks' finishing order."""
    if hold is not None:
        assert Event(hold).wait(BOUND_S), "the previous rank never released this one"
    out = whoami(prev)
    if release is not None:
        Event(release).set()
    return out


def test_gather_returns_each_ranks_result_in_rank_order_whatever_order_they_finish(client, group, events):
    """gather: one result per rank, in rank order, each computed on its own pinned worker, even when the ranks
    finish in reverse order; a progress bar moves once per finished rank."""
    assert group.names == [0, 1, 2]  # rank r is the worker whose name sorts r-th
    h0, h1 = events(), events()
    # rank 2 finishes first and releases rank 1, which then releases rank 0: they finish 2, 1, 0
    args = [(h0.name, None), (h1.name, h0.name), (None, h1.name)]

    class Bar:
        n = 0

        def update(self, k):
            self.n += k

    bar = Bar()
    out = group.gather(
        group.submit(relay, key_name="order", per_rank=args), what="order", progress=bar, timeout=BOUND_S
    )
    assert [o["worker"] for o in out] == [0, 1, 2]
    assert bar.n == 3


def test_a_chosen_worker_order_is_the_rank_order(client):
    """``workers=`` sets the ranks: rank 0 runs on the first named worker, and gather keeps that order."""
    g = WorkerGroup(client, workers=[2, 0])
    try:
        assert g.world_size == 2
        assert [o["worker"] for o in g.call(whoami, what="pinned", key_name="pinned")] == [2, 0]
    finally:
        g.release_lease()
    with pytest.raises(ValueError, match=r"workers \[7\] are not in the cluster"):
        WorkerGroup(client, workers=[7])


def test_gather_raises_the_ranks_warning_once(group):
    """A warning every rank raised comes back at the driver once, not once per rank."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = group.call(warn_once, what="warned", key_name="warned")
    assert out == [0, 1, 2]
    assert [str(w.message) for w in caught] == ["the same warning from every rank"]


# ---------------------------------------------------------------------------------------- (b) failures


def test_one_rank_failing_names_the_rank_and_the_group_keeps_working(group):
    """A rank's error comes back as RankFailedError naming the call, rank and worker, with the rank's exception as
    its cause; its peers finished, so the group is not broken and the next call runs (worker_group: "the Policy
    keeps working after a rejected or failed call")."""
    with pytest.raises(
        RankFailedError,
        match=r"^scoring failed on rank 1 \(worker 1\): RuntimeError: boom on "
        r"worker 1$",
    ) as info:
        group.call(
            lambda prev, bad: fail(prev) if bad else whoami(prev),
            what="scoring",
            key_name="fail1",
            per_rank=[(False,), (True,), (False,)],
        )
    assert type(info.value) is RankFailedError and isinstance(info.value.__cause__, RuntimeError)
    assert group.broken is None
    assert [o["worker"] for o in group.call(whoami, what="next", key_name="next")] == [0, 1, 2]


def test_a_value_error_comes_back_as_raised(group):
    """A ValueError (bad input) is the user's to fix: gather raises it as the rank raised it, not wrapped."""
    with pytest.raises(ValueError, match=r"^bad input on this rank$") as info:
        group.call(fail, "value", what="v", key_name="v", ranks=[0])
    assert not isinstance(info.value, RankFailedError)
    assert group.broken is None


def test_the_root_cause_is_reported_not_the_peer_that_learned_of_it(group):
    """When one rank fails and another only learned that a peer failed (PeerFailedError), the error names the rank
    with the root cause, whichever failed first."""
    with pytest.raises(RankFailedError, match=r"on rank 2 \(worker 2\): RuntimeError: boom on worker 2"):
        group.call(fail, what="root", key_name="root", per_rank=[("peer",), ("peer",), ("runtime",)])


def test_a_peer_stuck_after_a_failure_breaks_the_group_for_every_later_call(client, group, events):
    """Rank 0 fails while rank 1 is still running (as a rank in a collective would): the call raises rank 0's
    error, and after ``settle_timeout_s`` the group is broken, naming the stuck worker. Every later call then
    refuses with the same class and text; the remedy the message names is a new group,
    and one made on the same workers runs."""
    stuck, rank2_done = events(), events()
    group.settle_timeout_s = 1.0  # how long a failed call's peers get to fail too (10 s in real use)
    # rank 0 fails only once rank 2 has finished, so that rank 1 is the one rank still running, however slow the
    # machine
    args = [("fail", rank2_done.name), ("hold", stuck.name), ("ok", rank2_done.name)]

    def mixed(prev, what, event):
        if what == "fail":
            assert Event(event).wait(BOUND_S)
            return fail(prev)
        if what == "hold":
            return wait_then_whoami(prev, event)
        return set_then_whoami(prev, event)

    with pytest.raises(RankFailedError, match=r"^train failed on rank 0 \(worker 0\)"):
        group.gather(group.submit(mixed, key_name="stuck", per_rank=args), what="train", timeout=BOUND_S)
    assert isinstance(group.broken, RankFailedError) and not isinstance(group.broken, WorkerLostError)
    message = str(group.broken)
    assert message.startswith("workers [1] did not finish train after a peer failed")
    assert "create it again" in message
    for later in (
        lambda: group.call(whoami, what="later", key_name="later"),
        lambda: group.scatter([1, 2, 3], what="later"),
    ):
        with pytest.raises(RankFailedError) as info:
            later()
        assert type(info.value) is RankFailedError and str(info.value) == message
    stuck.set()  # the stuck rank leaves its "collective"
    fresh = WorkerGroup(client, workers=group.names)
    try:
        assert [o["worker"] for o in fresh.call(whoami, what="fresh", key_name="fresh")] == [0, 1, 2]
    finally:
        fresh.release_lease()


# ---------------------------------------------------------------------------------------- (c) the chain


def test_each_rank_runs_after_its_previous_task_and_gets_its_result(group, events):
    """Chained calls: rank r's next task depends on its previous one (it gets that result as ``prev``), so it waits
    for it even when the earlier task is held; a gathered call lets go of the chain (the next call starts fresh)."""
    hold = events()
    first = group.submit(wait_then_whoami, hold.name, "first", key_name="first")
    second = group.submit(whoami, "second", key_name="second")
    hold.set()
    out = group.gather(second, what="second", timeout=BOUND_S)
    assert [o["prev"]["tag"] for o in out] == ["first"] * 3
    assert [o["prev"]["worker"] for o in out] == [o["worker"] for o in out] == [0, 1, 2]
    group.gather(first, what="first", timeout=BOUND_S)
    # gathered: the chain let go of both, so a new call gets no previous result
    assert [o["prev"] for o in group.call(whoami, what="third", key_name="third")] == [None] * 3


def test_an_unchained_task_neither_waits_on_nor_joins_the_chain(group, events):
    """``chain=False`` (a side task such as the rendezvous port): it runs on a rank while that rank's chained call
    is held (it does not wait on the chain), and the rank's next chained call follows the chained one, not it."""
    hold = events()
    first = group.submit(wait_then_whoami, hold.name, "chained", key_name="chained", ranks=[0])
    # chained on `first`, this gather would run out of its bound: `first` is held until after it
    side = group.submit(whoami, "side", key_name="side", ranks=[0, 1], chain=False)
    assert [o["prev"] for o in group.gather(side, what="side", timeout=BOUND_S)] == [None, None]
    nxt = group.submit(whoami, "next", key_name="after", ranks=[0, 1])
    hold.set()
    out = group.gather(nxt, what="after", timeout=BOUND_S)
    assert out[0]["prev"]["tag"] == "chained"  # rank 0 chained on its held task
    assert out[1]["prev"] is None  # rank 1's side task never joined its chain
    group.gather(first, what="chained", timeout=BOUND_S)


def test_after_a_failed_call_the_chain_starts_again(group):
    """A failed task must not stay at the head of its rank's chain: Dask fails every task whose dependency
    failed, so the next call would fail with the old error. The next call runs on every rank, and the rank that
    failed starts its chain again (no previous result)."""
    with pytest.raises(RankFailedError):
        group.call(
            lambda prev, bad: fail(prev) if bad else whoami(prev),
            what="bad",
            key_name="bad",
            per_rank=[(False,), (True,), (False,)],
        )
    out = group.call(whoami, what="after", key_name="after")
    assert [o["worker"] for o in out] == [0, 1, 2]
    assert out[1]["prev"] is None


def test_a_failed_call_nobody_gathered_is_not_chained_on(group):
    """A chained call that failed and was never gathered (a future the caller holds): the next call on that rank
    runs without it, instead of inheriting its error."""
    failed = group.submit(fail, key_name="ungathered", ranks=[1])
    wait(failed, timeout=BOUND_S)
    assert failed[0].status == "error"
    out = group.call(whoami, what="next", key_name="next", ranks=[1])
    assert out == [{"worker": 1, "prev": None, "tag": None}]


def test_settled_futures_raise_the_ranks_error_and_the_chain_goes_on(client, group):
    """``settle=True``: the futures handed back resolve to each rank's result or raise its own error, while that
    rank's chain goes on past the failure (the next chained call runs after it and is not failed by it)."""
    futures = group.submit(
        lambda prev, bad: fail(prev) if bad else whoami(prev, "settled"),
        key_name="settled",
        per_rank=[(False,), (True,), (False,)],
        settle=True,
    )
    wait(futures, timeout=BOUND_S)
    assert client.gather(futures[0])["tag"] == "settled"
    with pytest.raises(RuntimeError, match=r"^boom on worker 1$"):
        client.gather(futures[1])
    out = group.call(whoami, what="next", key_name="next", ranks=[1])
    assert out[0]["worker"] == 1 and out[0]["prev"] is not None  # chained on the settled (finished) task


# ---------------------------------------------------------------------------------------- (d) a lost worker


@pytest.fixture()
def own_cluster():
    """Two workers of which the test closes one: a cluster of the test's own."""
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cl,
        Client(cl) as c,
    ):
        yield cl, c


def _close_worker(cluster, name):
    worker = next(w for w in cluster.workers.values() if w.name == name)
    # executor_wait=False: the task held on it is abandoned, as a killed process would abandon it
    cluster.sync(worker.close, executor_wait=False)
    assert name not in {ws.name for ws in cluster.scheduler.workers.values()}, "the scheduler still lists it"


def test_a_worker_closed_mid_call_is_a_worker_lost_error_on_this_and_every_later_call(own_cluster, events):
    """Rank 1's worker dies while both ranks are in a call; rank 0, in a collective with it, then fails (its
    transport notices the dead peer). The call raises WorkerLostError naming the worker, its rank and the call,
    within the bound rather than hanging; the group is broken with that error, and every later call raises it."""
    cluster, client = own_cluster
    group = WorkerGroup(client)
    group.settle_timeout_s = 0.5
    hold, notice = events(), events()
    futures = group.submit(
        lambda prev, r: peer_gone(prev, notice.name) if r == 0 else wait_then_whoami(prev, hold.name),
        key_name="lost",
        per_rank=[(0,), (1,)],
    )
    _close_worker(cluster, 1)
    notice.set()  # rank 0's collective now fails, as gloo's does when its peer's socket closes
    message = "worker 1 (rank 1 of 2) died or restarted during get_logprobs"
    with pytest.raises(WorkerLostError) as info:
        group.gather(futures, what="get_logprobs", timeout=BOUND_S)
    assert str(info.value).startswith(message) and "create a new Policy" in str(info.value)
    assert isinstance(group.broken, WorkerLostError)
    for _ in range(2):
        with pytest.raises(WorkerLostError) as later:
            group.call(whoami, what="something else", key_name="later")
        assert str(later.value) == str(info.value)  # the first call that saw the loss names it, every time
    group.release_lease()


def test_a_worker_closed_mid_call_while_its_peer_finished_is_a_worker_lost_error(own_cluster, events):
    """The module's promise ("a lost rank fails the call with an error naming it") when no peer fails with it:
    rank 0 finishes, rank 1's worker dies mid-task. Expected: WorkerLostError naming rank 1, not a hang."""
    cluster, client = own_cluster
    group = WorkerGroup(client)
    hold = events()
    futures = group.submit(
        lambda prev, r: whoami(prev) if r == 0 else wait_then_whoami(prev, hold.name),
        key_name="lost-alone",
        per_rank=[(0,), (1,)],
    )
    wait(futures[0], timeout=BOUND_S)
    _close_worker(cluster, 1)
    try:
        with pytest.raises(WorkerLostError, match=r"worker 1 \(rank 1 of 2\) died or restarted during score"):
            group.gather(futures, what="score", timeout=5)
    finally:
        group.release_lease()
