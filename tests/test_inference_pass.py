"""The shared inference loop (model/inference.py) and the fused head's CPU path, against plain references."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dask_lm.data.tokens import TokenRows
from dask_lm.model import fused
from dask_lm.model.forward import MicroBatch
from dask_lm.model.inference import host_layout, run_pass


def _rows(lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (len(lengths), width), generator=g)
    lens = torch.tensor(lengths)
    ids[torch.arange(width)[None, :] >= lens[:, None]] = 0
    return ids, lens


def test_host_layout_packed_matches_a_loop():
    ids, lens = _rows([5, 1, 3], 6)
    lay = host_layout(TokenRows.from_padded(ids, lens), packed=True)
    flat, pos, scored = [], [], []
    for b, n in enumerate(lens.tolist()):
        start = len(flat)
        flat += ids[b, :n].tolist()
        pos += list(range(n))
        scored += [start + p for p in range(n - 1)]  # position p predicts p + 1 of the same row
    assert lay.packed_ids.tolist() == [flat] and lay.position_ids.tolist() == [pos]
    assert lay.cu.tolist() == [0, 5, 6, 9] and lay.cu.dtype == torch.int32 and lay.width == 5
    assert lay.scored[1].tolist() == scored and lay.scored[0].tolist() == [0] * len(scored)
    assert lay.valid[1].tolist() == list(range(9))


def test_host_layout_padded_matches_the_valid_mask():
    ids, lens = _rows([2, 4, 1], 7)
    lay = host_layout(TokenRows.from_padded(ids, lens), packed=False)
    assert lay.width == 4 and lay.cu is None
    valid = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert [t.tolist() for t in lay.valid] == [t.tolist() for t in valid.nonzero(as_tuple=True)]
    assert [t.tolist() for t in lay.scored] == [t.tolist() for t in valid[:, 1:].nonzero(as_tuple=True)]


class _FakeWorker:
    """Just enough of RankModel for run_pass: a plan, a 'forward' returning each token's id as its hidden
    state, and a record of the pass ending."""

    compile = False

    def __init__(self, plan: list[MicroBatch]) -> None:
        self.plan, self.finished = plan, 0

    def compiled_now(self):
        return self.compile

    def plan_pass(self, data, plan, mbs):
        return self.plan

    def inference_forward(self, data, mb):
        if mb.end == mb.start:
            return torch.zeros(1, 1), None
        part = data.slice(mb.start, mb.end)
        lay = host_layout(part, packed=mb.packed)
        hidden = (lay.packed_ids if mb.packed else part.padded()).float()
        return hidden, SimpleNamespace(host=lay)

    def end_pass(self):
        self.finished += 1


def test_run_pass_writes_every_token_and_row_where_it_belongs():
    ids, lens = _rows([5, 1, 3, 6, 2], 8)
    data = TokenRows.from_padded(ids, lens)
    plan = [
        MicroBatch(0, 2, packed=True),
        MicroBatch(2, 4),
        MicroBatch(4, 5, packed=True),
        MicroBatch(0, 1, packed=True, dummy=True),
    ]
    worker = _FakeWorker(plan)
    per_token = torch.full((5, 8), -1.0)
    doubled = torch.full((5, 8, 2), -1.0)
    run_pass(worker, data, {}, None, lambda h, layout: (h, torch.stack([h, 2 * h], -1)), (per_token, doubled))
    valid = torch.arange(8)[None, :] < lens[:, None]
    # every real token got its own id back, padding kept the output's fill value (padded micro-batches write
    # their [b, L] block up to the longest row of the micro-batch; row 2 is padded to 6)
    assert torch.equal(per_token[valid], ids[valid].float())
    assert torch.equal(doubled[valid], torch.stack([ids[valid].float(), 2 * ids[valid].float()], -1))
    assert per_token[0, 5:].eq(-1).all() and per_token[4, 2:].eq(-1).all() and per_token[3, 6:].eq(-1).all()
    assert worker.finished == 1
    scores = torch.zeros(5)
    run_pass(
        _FakeWorker(plan[:3]),
        data,
        {},
        None,
        lambda h, layout: (torch.as_tensor(layout.host.lens, dtype=torch.float32),),
        (scores,),
        per_row=True,
    )
    assert scores.tolist() == lens.float().tolist()


def test_run_pass_ends_the_pass_when_a_micro_batch_fails():
    ids, lens = _rows([3, 2], 4)
    worker = _FakeWorker([MicroBatch(0, 1), MicroBatch(1, 2)])

    def boom(h, layout):
        raise RuntimeError("head failed")

    try:
        run_pass(worker, TokenRows.from_padded(ids, lens), {}, None, boom, (torch.zeros(2, 4),))
    except RuntimeError as e:
        assert "head failed" in str(e)
    else:
        raise AssertionError("the error was swallowed")
    assert worker.finished == 1  # FSDP ranks reshard even after a failure


def test_fused_head_reductions_on_the_cpu_are_the_plain_expressions():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 50, generator=g) * 4
    targets = torch.randint(0, 50, (20,), generator=g)[3:10]  # a view, as the chunked head passes
    for t in (1.0, 0.6):
        want = torch.log_softmax(logits / t, -1).gather(1, targets[:, None])[:, 0]
        torch.testing.assert_close(fused.pick_minus_logsumexp(logits, targets, t), want, atol=1e-5, rtol=0)
        torch.testing.assert_close(fused.logsumexp(logits, t), torch.logsumexp(logits / t, -1), atol=1e-5, rtol=0)
    assert not fused._COMPILED  # the CPU never compiles


def test_scorer_packed_micro_batches_equal_padded_ones_and_hf(tiny):
    """The scorer packs rows on GPUs; its packed path (here through the exact block mask) gives the padded path's
    logprobs and top-k, which equal a plain Hugging Face forward, row by row."""
    from dask_lm.data.messages import ScoreOptions
    from dask_lm.scoring import replicas, scorer

    opts = ScoreOptions(
        model=tiny["llama"],
        tokenizer=tiny["llama"],
        precision="float32",
        output="-",
        topk=3,
        batch_tokens=40,
        chunk_size=7,
    )
    rep = replicas.Replica(opts.model, opts.tokenizer, opts.precision)
    assert not rep.packed and not rep.compiled  # the CPU pads and stays eager
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (9, 1, 17, 4, 0, 12)]
    with torch.no_grad():  # and a row HF decoded greedily, whose every token is the argmax (random rows: few are)
        ids.append(model.generate(torch.tensor([[5, 9]]), max_new_tokens=8, do_sample=False)[0].tolist())
    padded = scorer.score_ids(rep, ids, opts)
    rep.packed = True
    packed = scorer.score_ids(rep, ids, opts)
    for i, row in enumerate(ids):
        for lps, tops, finite, greedy in (padded, packed):
            assert finite[i] and lps[i].shape == (len(row),) and greedy[i].shape == (len(row),)
            if not row:
                continue
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([row])).logits[0].float(), -1)
            want = torch.zeros(len(row))
            want[1:] = logp[:-1].gather(1, torch.tensor(row[1:])[:, None])[:, 0]
            torch.testing.assert_close(lps[i], want, atol=1e-4, rtol=0)
            top = logp.topk(3, -1)
            torch.testing.assert_close(tops[i][1], top.values, atol=1e-4, rtol=0)
            assert tops[i][0].tolist() == top.indices.tolist()
            # is_greedy's input: the token is HF's argmax at the position before it (position 0: true)
            assert greedy[i].tolist() == [True] + (logp[:-1].argmax(-1) == torch.tensor(row[1:])).tolist()
        assert padded[3][-1][2:].all() and packed[3][-1][2:].all()  # the generated row: greedy past its prompt


def test_longest_first_batches_respect_the_budget():
    from dask_lm.data.packing import longest_first

    lengths = [5, 30, 12, 7, 41, 3]
    for padded in (False, True):
        batches = longest_first(lengths, 40, padded=padded)
        assert [i for b in batches for i in b] == sorted(range(len(lengths)), key=lambda i: -lengths[i])
        for b in batches:
            cost = len(b) * max(lengths[i] for i in b) if padded else sum(lengths[i] for i in b)
            assert cost <= 40 or len(b) == 1
    # by hand: 41 and 30 each alone (together they exceed 40), then 12 + 7 + 5 + 3 = 27 real tokens, or padded
    # to 12 while 4 rows would cost 48
    assert longest_first(lengths, 40) == [[4], [1], [2, 3, 0, 5]]
    assert longest_first(lengths, 40, padded=True) == [[4], [1], [2, 3, 0], [5]]


def test_a_failed_compilation_falls_back_to_eager_once(monkeypatch, caplog):
    """No C compiler, an op Inductor cannot lower: the head warns once and computes eagerly, with the same values."""
    calls = []

    def fake_compile(fn, **kwargs):
        def broken(*args):
            calls.append(1)
            raise torch._dynamo.exc.TorchDynamoException("no C compiler found")

        return broken

    monkeypatch.setattr(fused, "_compilable", lambda t: True)
    monkeypatch.setattr(fused.torch, "compile", fake_compile)
    monkeypatch.setattr(fused, "_COMPILED", {})
    monkeypatch.setattr(fused, "_BROKEN", set())
    logits, targets = torch.randn(4, 30), torch.tensor([1, 5, 29, 0])
    want = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    for _ in range(2):
        torch.testing.assert_close(fused.pick_minus_logsumexp(logits, targets), want, atol=1e-5, rtol=0)
    assert len(calls) == 1 and "pick_minus_lse" in fused._BROKEN
    assert "running it eagerly" in caplog.text


def test_a_failed_decoder_compilation_turns_compilation_off_for_the_rank(caplog):
    from dask_lm.workers.rank_model import RankModel

    class Rank:
        compile = True
        compile_ahead = None  # no background compile: the call compiles
        calls = 0
        compiled_now = RankModel.compiled_now

        def forward_micro_batch(self, data, mb):
            self.calls += 1
            if self.calls == 1:
                raise torch._dynamo.exc.TorchDynamoException("Inductor cannot lower this op")
            return "hidden", {"info": 1}

    rows, mb = TokenRows.from_lists([[5, 6], [7]]), MicroBatch(0, 2)
    rank = Rank()
    assert RankModel.inference_forward(rank, rows, mb) == ("hidden", {"info": 1})
    assert rank.compile is False and rank.calls == 2 and "runs eagerly from now on" in caplog.text

    class Broken(Rank):
        def forward_micro_batch(self, data, mb):
            raise ValueError("a real error of the forward")

    try:
        RankModel.inference_forward(Broken(), rows, mb)
    except ValueError as e:
        assert "real error" in str(e)
    else:
        raise AssertionError("a forward error was swallowed")


def test_compiled_layers_run_only_inside_inference_and_only_in_that_thread(tiny, monkeypatch):
    """The per-thread switch: training / generation (outside ``inference``) and other threads run the eager layers."""
    import threading

    import transformers

    calls = []

    def fake_compile(fn, **kwargs):
        def compiled(*args, **kw):
            calls.append(threading.current_thread().name)
            return fn(*args, **kw)

        return compiled

    monkeypatch.setattr(fused.torch, "compile", fake_compile)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32).eval()
    n = fused.compile_decoder_layers(model, anywhere=True)
    assert n == model.config.num_hidden_layers
    ids = torch.randint(3, 100, (2, 9))
    with torch.no_grad():
        eager = model(ids).logits
        assert calls == []  # outside inference: eager
        with fused.use_compiled(True):
            inside = model(ids).logits
            other = threading.Thread(target=lambda: model(ids), name="trainer")
            other.start()
            other.join()
            with fused.use_compiled(False):
                model(ids)
        assert calls == ["MainThread"] * n  # once per layer, in this thread only, not in the nested eager block
    torch.testing.assert_close(inside, eager)
