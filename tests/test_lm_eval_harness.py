"""The lm-evaluation-harness model class (``--model dask-lm``, :mod:`dask_lm.harness`) against lm-eval's own
``HFLM`` on the same tiny models and the same requests: every number and string here comes from HFLM, the
independent reference, never from an earlier run of ours. The models are tiny random Llamas beside tokenizers
trained on the fly (tests/tokenizer_kinds.py); the cluster is the session's 2-worker CPU LocalCluster."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from helpers import extra
from tokenizer_kinds import build

from dask_lm.tiny import SAMPLE_TEXTS, build_tiny_model

# the test extra: a missing lm_eval fails these tests, it does not skip them (and the module still collects)
lm_eval = extra("lm_eval")
lm_eval_api = extra("lm_eval.api.instance")
lm_eval_hf = extra("lm_eval.models.huggingface")
harness = extra("dask_lm.harness")  # imports lm_eval

pytestmark = pytest.mark.cluster

SHORT = 16  # positions of the "short" model: rolling windows roll and long requests are left-truncated


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_models")
    dirs = {kind: build(kind, str(root / kind)) for kind in ("gpt2", "llama2")}
    # the gpt2-kind tokenizer beside a model of only SHORT positions: lm-eval's default max_length is then SHORT,
    # and a truncated request is one token longer than the model's positions (its last token only a target)
    short = build("gpt2", str(root / "short"))
    from transformers import AutoTokenizer

    build_tiny_model(short, vocab_size=len(AutoTokenizer.from_pretrained(short)), max_position_embeddings=SHORT, seed=5)
    dirs["short"] = short
    return dirs


@pytest.fixture(scope="module")
def pair(model_dirs, client):
    """(HFLM, DaskLM) per model, built once. HFLM with batch_size=1, which is how it generates per row, and without
    its logits cache: lm-eval 0.4.13 groups requests by context + continuation[:-1] tokens (models/huggingface.py:
    1350-1361) and, when several split one text at different points, gathers each continuation's logprobs from the
    first positions of the group's logits instead of the last (huggingface.py:1552; only is_greedy takes the
    trailing slice, line 1547): their sums come out wrong. _pairs() splits each text at every word, so it would hit
    that on purpose; the cache changes no other result."""
    made: dict[str, tuple[Any, Any]] = {}

    def get(name: str) -> tuple[Any, Any]:
        if name not in made:
            hf = lm_eval_hf.HFLM(
                pretrained=model_dirs[name], device="cpu", dtype="float32", batch_size=1, logits_cache=False
            )
            made[name] = hf, harness.DaskLM(pretrained=model_dirs[name], client=client, dtype="float32")
        return made[name]

    yield get
    for _, ours in made.values():
        ours.close()


def _instances(kind: str, args: list[tuple]) -> list[Any]:
    return [lm_eval_api.Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def _pairs() -> list[tuple[str, str]]:
    """Multiple-choice-like (context, continuation) pairs: split at every word of the sample texts, with and
    without the space moved onto the context, plus empty contexts."""
    out = []
    for text in [*SAMPLE_TEXTS, "Answer: 42", "Q: what is it? A: yes!"]:
        words = text.split(" ")
        for k in range(1, len(words)):
            head, tail = " ".join(words[:k]), " ".join(words[k:])
            out.append((head, " " + tail) if k % 2 else (head + " ", tail))
    return out + [("", "hello world"), ("", SAMPLE_TEXTS[0])]


def _coherent(hf: Any, context: str, continuation: str) -> bool:
    """Whether lm-eval's own split is sound here: an empty context, or a context whose encoding is a prefix of the
    whole text's (elsewhere lm-eval drops or repeats a token, and dask-lm's convention deliberately differs)."""
    if not context:
        return True
    stripped = context.rstrip()
    head, whole = hf.tok_encode(stripped), hf.tok_encode(context + continuation)
    return whole[: len(head)] == head and len(whole) > len(head)


@pytest.mark.parametrize("name", ["gpt2", "llama2"])
def test_loglikelihood_matches_hflm_in_request_order(pair, client, name):
    from distributed import get_task_stream

    hf, ours = pair(name)
    args = [p for p in _pairs() if _coherent(hf, *p)]
    assert len(args) >= 30, len(args)
    requests = _instances("loglikelihood", args)
    want = hf.loglikelihood(requests)
    with get_task_stream(client) as stream:
        got = ours.loglikelihood(requests)
    assert len(got) == len(want)
    for i, ((lp, greedy), (ref, ref_greedy)) in enumerate(zip(got, want)):
        assert lp == pytest.approx(ref, abs=1e-4), (i, args[i])
        assert greedy == ref_greedy, (i, args[i])
    # the requests went out as several tasks, and both workers of the cluster ran some
    workers = {t["worker"] for t in stream.data if "loglikelihood_requests" in str(t["key"])}
    assert len(workers) == 2, stream.data


def test_truncated_requests_and_rolling_windows_match_hflm(pair):
    hf, ours = pair("short")
    assert ours.max_length == hf.max_length == SHORT
    long_text = " ".join(SAMPLE_TEXTS[:4])  # far longer than SHORT tokens: many windows
    texts = [long_text, SAMPLE_TEXTS[5], "Answer: 42", SAMPLE_TEXTS[0] + " " + SAMPLE_TEXTS[1]]
    assert len(hf.tok_encode(long_text)) > 4 * SHORT
    rolling = _instances("loglikelihood_rolling", [(t,) for t in texts])
    for got, want in zip(ours.loglikelihood_rolling(rolling), hf.loglikelihood_rolling(rolling), strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    # contexts longer than the model reads keep their last tokens, as HFLM cuts them
    args = [(long_text, " the end"), (SAMPLE_TEXTS[2] + " " + SAMPLE_TEXTS[3], " Answer: 42"), ("Answer:", " 42")]
    requests = _instances("loglikelihood", [a for a in args if _coherent(hf, *a)])
    assert len(requests) >= 2
    for got, want in zip(ours.loglikelihood(requests), hf.loglikelihood(requests), strict=True):
        assert got[0] == pytest.approx(want[0], abs=1e-4) and got[1] == want[1]


@pytest.mark.parametrize("name", ["gpt2", "llama2", "short"])
def test_generate_until_matches_hflm(pair, name):
    hf, ours = pair(name)
    contexts = [
        "The quick brown",
        "Dask schedules tasks",
        "Q: what is it? A:",
        " ".join(SAMPLE_TEXTS[:3]),
        "Numbers like 3, 14",
        "hello",
    ]
    # stop strings the random models produce early, so rows stop (and are cut) at different points
    kwargs = [
        {"until": ["e"], "max_gen_toks": 12},
        {"until": ["s", "o"], "max_gen_toks": 10, "do_sample": False},
        {"until": "\n", "max_gen_toks": 5, "temperature": 0.0},
    ]
    requests = _instances("generate_until", [(c, kwargs[i % len(kwargs)]) for i, c in enumerate(contexts)])
    assert ours.generate_until(requests) == hf.generate_until(requests)


def test_add_bos_token_is_hflms(model_dirs, client):
    """``add_bos_token=False`` on a tokenizer that adds BOS: lm-eval's own split and encodings, as HFLM's."""
    hf = lm_eval_hf.HFLM(
        pretrained=model_dirs["llama2"],
        device="cpu",
        dtype="float32",
        batch_size=2,
        logits_cache=False,
        add_bos_token=False,
    )
    ours = harness.DaskLM(pretrained=model_dirs["llama2"], client=client, add_bos_token="false")
    try:
        from transformers import AutoTokenizer

        plain = AutoTokenizer.from_pretrained(model_dirs["llama2"])("hello world").input_ids  # with its BOS
        assert ours.tok_encode("hello world") == hf.tok_encode("hello world") == plain[1:]
        requests = _instances("loglikelihood", [p for p in _pairs()[::3] if _coherent(hf, *p)])
        for got, want in zip(ours.loglikelihood(requests), hf.loglikelihood(requests), strict=True):
            assert got[0] == pytest.approx(want[0], abs=1e-4) and got[1] == want[1]
        rolling = _instances("loglikelihood_rolling", [(t,) for t in SAMPLE_TEXTS[:3]])
        assert ours.loglikelihood_rolling(rolling) == pytest.approx(hf.loglikelihood_rolling(rolling), abs=1e-4)
    finally:
        ours.close()


def _write_tasks(root) -> list[str]:
    """Three local tasks over jsonl files (no downloads): multiple choice, perplexity, generation."""

    def jsonl(name: str, rows: list[dict]) -> str:
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    choices = ["fox", "dog", "cluster", "token"]
    mc = jsonl(
        "mc",
        [
            {"question": f"{t.split(' ')[0]} {t.split(' ')[1]}", "choices": choices, "label": i % 4}
            for i, t in enumerate(SAMPLE_TEXTS)
        ],
    )
    ppl = jsonl("ppl", [{"text": " ".join(SAMPLE_TEXTS[i : i + 3])} for i in range(0, 8, 2)])
    gen = jsonl("gen", [{"question": t[:14], "answer": t[14:20]} for t in SAMPLE_TEXTS[:6]])
    cache = str(root / "hf_datasets")
    specs = {
        "dlm_mc": (
            mc,
            (
                "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: choices\n"
                "doc_to_target: label\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
            ),
        ),
        "dlm_ppl": (
            ppl,
            (
                "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
                "  - metric: bits_per_byte\n"
            ),
        ),
        "dlm_gen": (
            gen,
            (
                "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
                "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 5\n  do_sample: false\n"
                "metric_list:\n  - metric: exact_match\n"
            ),
        ),
    }
    for task, (data, body) in specs.items():
        (root / f"{task}.yaml").write_text(
            f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"  cache_dir: {cache}\ntest_split: test\n{body}"
        )
    return list(specs)


def test_simple_evaluate_gives_hflms_metrics_on_local_tasks(pair, tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = _write_tasks(tmp_path)
    hf, ours = pair("short")
    results = {}
    for name, lm in (("hf", hf), ("dask-lm", ours)):
        manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
        results[name] = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, log_samples=True)
    want, got = results["hf"]["results"], results["dask-lm"]["results"]
    for task in tasks:
        metrics = {k: v for k, v in want[task].items() if k.endswith(",none") and "stderr" not in k}
        assert metrics, want[task]
        for key, value in metrics.items():
            exact = key.startswith(("acc", "exact_match"))
            assert got[task][key] == (value if exact else pytest.approx(value, rel=1e-5, abs=1e-4)), (task, key)
    # per document, the model's answers themselves agree (a metric can agree by chance)
    for task in tasks:
        ref = [s["filtered_resps"] for s in results["hf"]["samples"][task]]
        mine = [s["filtered_resps"] for s in results["dask-lm"]["samples"][task]]
        assert len(mine) == len(ref) > 0
        _assert_same(mine, ref)


def _assert_same(got, want) -> None:
    """Equal strings and booleans, numbers within 1e-4, through nested lists and tuples."""
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want)
        for a, b in zip(got, want):
            _assert_same(a, b)
    elif isinstance(want, (str, bool)) or want is None:
        assert got == want
    else:
        assert float(got) == pytest.approx(float(want), abs=1e-4)


def test_a_bad_model_arg_is_a_valueerror_naming_it(model_dirs, client):
    from lm_eval.api.registry import get_model

    assert get_model("dask-lm") is harness.DaskLM
    with pytest.raises(ValueError, match="'bogus_key'"):
        get_model("dask-lm").create_from_arg_string(
            f"pretrained={model_dirs['gpt2']},bogus_key=1", {"batch_size": 1, "device": "cpu"}
        )
    with pytest.raises(ValueError, match="n_workers='two'"):
        harness.DaskLM(pretrained=model_dirs["gpt2"], client=client, n_workers="two")
    with pytest.raises(ValueError, match="dtype='int8'"):
        harness.DaskLM(pretrained=model_dirs["gpt2"], client=client, dtype="int8")
    with pytest.raises(ValueError, match="pretrained"):
        harness.DaskLM(pretrained=os.path.join(model_dirs["gpt2"], "missing"), client=client)
