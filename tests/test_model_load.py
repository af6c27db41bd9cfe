"""The scoring replica's direct load (dask_lm.model.load) against transformers' own from_pretrained.

Every parameter and buffer must be the same, bit for bit, and the logits equal: for tied and untied models, one
file and an index of shards, the file's dtype kept or cast, on the CPU here (and on a GPU in tests/test_gpu.py).
Checkpoints the direct path does not handle must reach from_pretrained, not half-load.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
import transformers

from dask_lm.io import modelcheck
from dask_lm.model import load as model_load
from dask_lm.tiny import build_tiny_model


def _model_dir(tmp_path, family: str, *, tie: bool, shard: bool = False, dtype: torch.dtype = torch.float32) -> str:
    """A tiny model whose every tensor (norms and biases too, which a fresh model has at 1 and 0) is random."""
    path = build_tiny_model(str(tmp_path / "base"), family=family, tie_word_embeddings=tie, seed=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    out = str(tmp_path / "model")
    model.to(dtype).save_pretrained(out, max_shard_size="100KB" if shard else "5GB")
    return out


def _direct_only(monkeypatch) -> None:
    def refuse(*a, **k):
        raise AssertionError("the direct path fell back to from_pretrained")

    monkeypatch.setattr(model_load, "_from_pretrained", refuse)


def _same(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    ba, bb = dict(a.named_buffers()), dict(b.named_buffers())
    assert ba.keys() == bb.keys()
    for k in ba:
        assert torch.equal(ba[k], bb[k]), k
    x = torch.randint(3, a.config.vocab_size, (2, 17))
    with torch.no_grad():
        assert torch.equal(a(x).logits, b(x).logits)
    assert not a.training and a.config._attn_implementation == b.config._attn_implementation


@pytest.mark.parametrize(
    "family,tie,shard", [("qwen2", True, False), ("llama", False, False), ("llama", False, True), ("qwen2", True, True)]
)
def test_direct_load_equals_from_pretrained(tmp_path, monkeypatch, family, tie, shard):
    path = _model_dir(tmp_path, family, tie=tie, shard=shard)
    if shard:
        assert os.path.exists(os.path.join(path, modelcheck.SAFETENSORS_INDEX))
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _direct_only(monkeypatch)
    got = model_load.load_causal_lm(path, torch.float32, torch.device("cpu"))
    _same(got, reference)
    if tie:
        assert got.get_output_embeddings().weight is got.get_input_embeddings().weight


@pytest.mark.parametrize("stored,target", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_direct_load_casts_as_from_pretrained_does(tmp_path, monkeypatch, stored, target):
    path = _model_dir(tmp_path, "qwen2", tie=True, dtype=stored)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=target).eval()
    _direct_only(monkeypatch)
    got = model_load.load_causal_lm(path, target, torch.device("cpu"))
    assert got.dtype == target
    _same(got, reference)


def test_foreign_names_and_missing_tensors_go_through_from_pretrained(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    path = _model_dir(tmp_path, "llama", tie=False)
    file = os.path.join(path, modelcheck.SAFETENSORS)
    tensors = load_file(file)
    calls = []
    real = model_load._from_pretrained
    monkeypatch.setattr(model_load, "_from_pretrained", lambda *a: calls.append(a) or real(*a))

    save_file({**tensors, "model.extra.weight": torch.zeros(3)}, file, metadata={"format": "pt"})
    model_load.load_causal_lm(path, torch.float32, torch.device("cpu"))
    assert len(calls) == 1  # a name the model does not have: from_pretrained's own handling (it warns, ignores)

    missing = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    save_file(missing, file, metadata={"format": "pt"})
    model_load.load_causal_lm(path, torch.float32, torch.device("cpu"))
    assert len(calls) == 2  # an untied tensor no file holds: never left as uninitialised memory


def test_bin_weights_and_quantised_configs_are_not_taken_directly(tmp_path, monkeypatch):
    path = _model_dir(tmp_path, "llama", tie=False)
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text(pathlib.Path(path, "config.json").read_text())
    torch.save({"w": torch.zeros(1)}, binary / "pytorch_model.bin")  # transformers 5 saves safetensors only
    assert model_load.direct_files(str(binary)) is None

    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    with open(cfg_path, "w") as f:
        json.dump({**cfg, "quantization_config": {"quant_method": "fp8"}}, f)
    monkeypatch.setattr(model_load, "_from_pretrained", lambda *a: "from_pretrained")
    assert model_load.load_causal_lm(path, torch.float32, torch.device("cpu")) == "from_pretrained"


def test_a_policy_load_takes_its_config_kernel_and_generation_config_as_from_pretrained(tmp_path, monkeypatch):
    """A Policy's rank loads through the direct path with its own config (``hf_config_overrides`` applied) and
    attention kernel; the directory's generation config (its eos ids stop generation, a checkpoint saves it back)
    comes with it, as from_pretrained reads it."""
    path = _model_dir(tmp_path, "llama", tie=False)
    transformers.GenerationConfig(eos_token_id=[2, 7], max_new_tokens=5).save_pretrained(path)
    config = transformers.AutoConfig.from_pretrained(path, rms_norm_eps=1e-3)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    _direct_only(monkeypatch)
    got = model_load.load_pretrained(
        path, torch.float32, torch.device("cpu"), config=config, attn_implementation="eager"
    )
    _same(got, reference)
    assert got.config.rms_norm_eps == 1e-3 and got.config._attn_implementation == "eager"
    assert got.generation_config.eos_token_id == [2, 7] == reference.generation_config.eos_token_id
    assert got.generation_config.max_new_tokens == 5


def test_a_reward_head_the_files_lack_goes_through_from_pretrained(tmp_path):
    """A causal LM's files loaded as a sequence classifier: the ``score`` head is in no file, so from_pretrained
    builds it (with its own initialisation and report); the direct path does not leave it unfilled."""
    path = _model_dir(tmp_path, "llama", tie=False)
    config = transformers.AutoConfig.from_pretrained(path, num_labels=1, pad_token_id=0)
    auto = transformers.AutoModelForSequenceClassification
    torch.manual_seed(0)
    reference = auto.from_pretrained(path, config=config, dtype=torch.float32).eval()
    torch.manual_seed(0)
    got = model_load.load_pretrained(path, torch.float32, torch.device("cpu"), config=config, auto=auto)
    _same_weights = {k: v for k, v in got.state_dict().items() if not k.startswith("score")}
    for k, v in reference.state_dict().items():
        if not k.startswith("score"):
            assert torch.equal(_same_weights[k], v), k
    assert torch.equal(got.score.weight, reference.score.weight)
