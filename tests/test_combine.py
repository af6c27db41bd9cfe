"""The combine task joins a call's rank answers by the type of its join (``dask_lm.data.messages.Join``), one type
per kind of answer, each with its own function: no kind named by a string, no params dict. The references are
written out by hand: rows put back at their input positions, generation padded with the pad id, train results
reduced as NeMo RL's train() dict has them."""

from __future__ import annotations

import typing

import pytest
import torch

from dask_lm.data.messages import ForwardOutput, Join, JoinGenerated, JoinRows, ReduceTrain, TrainResult
from dask_lm.workers.combine import JOINS, combine


def test_every_join_type_has_one_function():
    assert set(JOINS) == set(typing.get_args(Join))
    with pytest.raises(AssertionError, match="no join for str"):
        combine("rows", [])  # type: ignore[arg-type]


def test_rows_go_back_to_their_input_positions():
    # input rows 0..3 were dealt out as rank 0: rows 2, 0 (width 3), rank 1: rows 3, 1 (width 2)
    rank0 = ForwardOutput({"logprobs": torch.tensor([[0.0, 2.1, 2.2], [0.0, 0.1, 0.2]])})
    rank1 = ForwardOutput({"logprobs": torch.tensor([[0.0, 3.1], [0.0, 1.1]])})
    out = combine(JoinRows(("logprobs",), [2, 0, 3, 1]), [rank0, rank1])
    expected = torch.tensor([[0.0, 0.1, 0.2], [0.0, 1.1, 0.0], [0.0, 2.1, 2.2], [0.0, 3.1, 0.0]])
    torch.testing.assert_close(out["logprobs"], expected, rtol=0, atol=0)
    scores = combine(
        JoinRows(("scores",), None, cat=True),
        [ForwardOutput({"scores": torch.tensor([1.0])}), ForwardOutput({"scores": torch.tensor([2.0])})],
    )
    torch.testing.assert_close(scores["scores"], torch.tensor([1.0, 2.0]), rtol=0, atol=0)


def test_generation_is_padded_with_the_pad_id():
    def rank(ids: list[list[int]]) -> ForwardOutput:
        t = torch.tensor(ids)
        n = torch.full((t.shape[0],), t.shape[1])
        return ForwardOutput(
            {
                "output_ids": t,
                "logprobs": torch.ones(t.shape),
                "generation_lengths": n,
                "unpadded_sequence_lengths": n,
                "truncated": torch.zeros(t.shape[0], dtype=torch.bool),
            }
        )

    out = combine(JoinGenerated(pad_token_id=7), [rank([[1, 2, 3]]), rank([[4]])])
    torch.testing.assert_close(out["output_ids"], torch.tensor([[1, 2, 3], [4, 7, 7]]), rtol=0, atol=0)
    torch.testing.assert_close(out["logprobs"], torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]), rtol=0, atol=0)


def test_train_results_reduce_to_nemo_rl_s_dict():
    def rank(r: int, seconds: float) -> TrainResult:
        return TrainResult(
            loss=torch.tensor([0.5]),
            grad_norm=torch.tensor([1.0]),
            grad_norms=[1.0],
            all_mb_metrics={"lr": [0.1 * (r + 1)]},
            train_elapsed_seconds=seconds,
            rank=r,
            gpu_name="cpu",
            model_dtype="float32",
            num_tokens=10 + r,
        )

    out = combine(ReduceTrain(total_flops=6e12), [rank(0, 2.0), rank(1, 3.0)])
    assert out["all_mb_metrics"] == {"lr": [0.1, 0.2]} and out["num_tokens"] == 21
    # the slowest rank's time; CPU ranks have no peak, so no MFU
    assert out["train_elapsed_seconds"] == 3.0 and out["achieved_tflops"] == pytest.approx(2.0)
    assert "mfu" not in out and out["num_ranks"] == 2
