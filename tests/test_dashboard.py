"""What a notebook user sees while dask-lm works: events, spans with token counts, Workers-table gauges, the rich
repr, and the live dashboard page in a real (headless) browser."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import transformers
from helpers import TEXTS, launch_chromium, make_batch, sft_batch

import dask_lm
from dask_lm import BatchedDataDict

pytestmark = pytest.mark.cluster


def _cfg(model_dir):
    return {
        "model_name": model_dir,
        "precision": "float32",
        "train_global_batch_size": 4,
        "train_micro_batch_size": 2,
        "max_total_sequence_length": 128,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3}},
    }


@pytest.fixture(scope="module")
def policy(client, tiny):
    tok = transformers.AutoTokenizer.from_pretrained(tiny["llama"])
    p = dask_lm.Policy(client, _cfg(tiny["llama"]), tok)
    p.tok = tok
    yield p
    p.shutdown()


def _span_tokens(name):
    def read(dask_scheduler):
        return sum(
            v
            for span in dask_scheduler.extensions["spans"].spans.values()
            if span.name and span.name[-1] == name
            for k, v in span.cumulative_worker_metrics.items()
            if k[-2:] == ("tokens", "count")
        )

    return read


def _wait_for(fn, what, timeout=30.0):
    deadline = time.time() + timeout
    while True:
        value = fn()
        if value or time.time() > deadline:
            assert value, f"timed out waiting for {what}"
            return value
        time.sleep(0.2)


def test_each_call_is_an_event_and_a_span_with_its_tokens(client, policy):
    ids, lens = make_batch(policy.tok, TEXTS)
    tokens = int(lens.sum())
    before = client.run_on_scheduler(_span_tokens("dask-lm/get_logprobs"))
    policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))
    # the fine performance metrics reach the scheduler with the workers' heartbeats
    _wait_for(
        lambda: client.run_on_scheduler(_span_tokens("dask-lm/get_logprobs")) - before == tokens,
        "the span's token count",
    )
    out = policy.train(sft_batch(policy.tok, TEXTS[:4]), dask_lm.NLLLoss())
    mine = [e for _, e in client.get_events("dask-lm") if e["policy"] == policy.group.policy_id]
    lp = [e for e in mine if e["call"] == "get_logprobs"][-1]
    assert lp["tokens"] == tokens and lp["rows"] == len(TEXTS) and lp["ranks"] == 2 and lp["seconds"] > 0
    train = [e for e in mine if e["call"] == "train"][-1]
    # events travel as msgpack (lists come back as tuples)
    assert list(train["loss"]) == pytest.approx(torch.as_tensor(out["loss"]).reshape(-1).tolist())
    assert train["grad_norm"] == pytest.approx(float(out["grad_norm"]))
    assert train["tokens"] == out["num_tokens"] and train["lr"] == pytest.approx(1e-3)


def test_training_over_several_global_batches_reports_progress(client, policy):
    data = sft_batch(policy.tok, TEXTS[:4] * 2)  # 8 rows, gbs 4: two global batches in one call

    def progress_events():
        return [e for _, e in client.get_events("dask-lm-progress")]

    before = len(progress_events())
    policy.train(data, dask_lm.NLLLoss())
    _wait_for(lambda: len(progress_events()) - before >= 2, "two progress events")
    new = progress_events()[before:]
    assert [e["done"] for e in new] == [1, 2] and len({e["id"] for e in new}) == 1  # rank 0 only, one call


def test_a_quiet_call_reports_no_progress(client, policy):
    """With progress off, a train call reports nothing: proven by the next, loud, call's events being the first
    to arrive after it, so a late event of the quiet call cannot slip past the check.

    Progress events are sent by rank 0 only (dask_lm.engine.progress), each through its worker's batched stream
    to the scheduler, which keeps them in the order they came. The quiet call finished on rank 0 before the loud
    one started there, so any event the quiet call sent is ahead of the loud call's in that one stream: once the
    loud call's last event is in, all of the quiet call's are too."""

    def progress_events():
        return [e for _, e in client.get_events("dask-lm-progress")]

    before = len(progress_events())
    dask_lm.set_progress(False)
    try:
        policy.train(sft_batch(policy.tok, TEXTS[:4] * 2), dask_lm.NLLLoss())  # two global batches, quiet
    finally:
        dask_lm.set_progress(True)
    # three global batches: its last event ("done": 3) is one the quiet call of two could not have sent
    policy.train(sft_batch(policy.tok, TEXTS[:4] * 3), dask_lm.NLLLoss())
    _wait_for(lambda: any(e["done"] == 3 for e in progress_events()[before:]), "the loud call's last event")
    new = progress_events()[before:]
    assert [e["done"] for e in new] == [1, 2, 3] and len({e["id"] for e in new}) == 1, new


def test_workers_table_gauges_and_policy_repr(client, policy):
    ids, lens = make_batch(policy.tok, TEXTS)
    policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))

    def gauges():
        info = client.scheduler_info(n_workers=-1)["workers"].values()
        g = {str(w["name"]): w["metrics"] for w in info}
        ok = all(
            g[str(n)].get("dask_lm_tokens_per_s", 0) > 0
            and g[str(n)].get("dask_lm_device_mem_gib", 0) > 0
            and g[str(n)].get("dask_lm_policies", 0) >= 1
            for n in policy.group.names
        )
        return g if ok else None

    _wait_for(gauges, "the dask-lm gauges in the scheduler's worker metrics")
    page = policy._repr_html_()
    assert policy.cfg.model_name in page and "float32" in page and "memory in use (GiB)" in page
    # one row per rank, each with its memory gauge (GiB, 2 decimals) and its tokens/s
    rows = re.findall(
        r"<tr><td[^>]*>(\d+)</td><td[^>]*>([^<]*)</td><td[^>]*>[^<]*</td><td[^>]*>cpu</td>"
        r"<td[^>]*>(\d+\.\d\d)</td><td[^>]*>([\d,]+)</td></tr>",
        page,
    )
    assert [(int(r), w) for r, w, _, _ in rows] == list(enumerate(map(str, policy.group.names)))
    assert all(float(m) > 0 and int(t.replace(",", "")) > 0 for _, _, m, t in rows)


def test_dashboard_workers_page_shows_the_dask_lm_columns_in_a_browser(client, policy, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    ids, lens = make_batch(policy.tok, TEXTS)
    policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))
    url = client.dashboard_link.replace("/status", "/workers")
    shot = os.path.join(
        os.environ.get("DASK_LM_TEST_ARTIFACTS") or str(tmp_path_factory.mktemp("artifacts")), "dashboard-workers.png"
    )
    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1800, "height": 900})
            page.goto(url)
            for column in ("dask_lm_tokens_per_s", "dask_lm_device_mem_gib", "dask_lm_policies"):
                page.get_by_text(column, exact=True).first.wait_for(timeout=30_000)
            page.screenshot(path=shot)
        finally:
            browser.close()
    print(f"\ndashboard screenshot: {shot}")
    assert os.path.getsize(shot) > 10_000
