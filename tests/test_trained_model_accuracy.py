"""The shipped tiny-sort model is confident and correct, the task is what it claims, training is reproducible.

Greedy generation here goes through the oracle's per-request API (`oracle.load(..., float64)`: prefill then
decode token by token), i.e. the prefill and decode paths of the truth, not the training forward.
"""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file

import oracle
from hybridqual.scenarios import task
from hybridqual.train_tiny import TinyBamba, batch_of, evaluate, tiny_sort_config, train

try:
    from tests.test_trained_model_forward import MODEL, _config
except ImportError:                      # tests/ is not a package: pytest puts it on sys.path
    from test_trained_model_forward import MODEL, _config

N_SUBSET = 50          # held-out examples generated in the CPU tier (the report covers >= 500)


@pytest.fixture(scope="module")
def step_model():
    return oracle.load(MODEL, dtype=torch.float64)


def test_oracle_greedy_answers_heldout_subset_exactly_with_margin(step_model):
    result = task.evaluate(step_model, task.heldout(N_SUBSET))
    assert result["accuracy"] >= 0.99, result["accuracy"]           # 50 examples: all must be right
    assert result["margins"]["median"] >= 5.0, result["margins"]


def test_train_report_records_the_bounds_over_500_heldout_examples():
    report = json.loads((MODEL / "train_report.json").read_text())
    held = report["heldout"]
    assert held["n"] >= 500 and held["seed"] == task.HELDOUT_SEED
    assert held["accuracy"] >= 0.99 and held["margins"]["median"] >= 5.0


def test_task_prompts_exceed_two_ssd_chunks_and_answers_are_long():
    chunk = _config()["mamba_chunk_size"]
    for ex in task.heldout(200):
        assert len(ex.prompt) > 2 * chunk and len(ex.answer) >= 16
        digits = ex.prompt[1:-1]
        assert ex.prompt[0] == task.BOS and ex.prompt[-1] == task.SEP
        assert ex.answer == (*sorted(digits), task.EOS)


def test_task_streams_are_deterministic_and_distinct():
    assert task.make_examples(7, 30) == task.make_examples(7, 30)
    assert task.make_examples(7, 30) != task.make_examples(8, 30)
    assert task.heldout(10) == task.make_examples(task.HELDOUT_SEED, 10)


def test_exact_match_rejects_any_deviation():
    ex = task.make_example(random.Random(3))
    good = list(ex.answer)
    assert task.exact_match(ex.answer, good)
    swapped = good[:]
    swapped[0], swapped[-2] = swapped[-2], swapped[0]
    assert swapped == good or not task.exact_match(ex.answer, swapped)
    assert not task.exact_match(ex.answer, good[:-1])                 # missing EOS
    assert not task.exact_match(ex.answer, good + [task.EOS])         # extra token
    assert task.accuracy([ex, ex], [good, good[:-1]]) == 0.5
    with pytest.raises(ValueError, match="outputs"):
        task.accuracy([ex], [])


def test_margin_is_top1_minus_top2():
    logits = torch.tensor([[0.0, 3.0, 1.5, -2.0], [2.0, 2.0, 0.0, 0.0]])
    assert task.top2_margin(logits).tolist() == [1.5, 0.0]
    stats = task.margin_stats([1.0, 3.0, 2.0])
    assert stats["median"] == 2.0 and stats["min"] == 1.0


def test_training_is_reproducible_from_seed(one_thread):
    a, b, c = (train(seed=s, steps=3, batch=4, lr=1e-3, threads=1, n_eval=2, log_every=10**9, n_probe=0)[0]
               for s in (11, 11, 12))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_training_loss_masks_everything_but_the_answer():
    exs = task.make_examples(5, 3)
    ids, tgt = batch_of(exs)
    for i, ex in enumerate(exs):
        labelled = tgt[i][tgt[i] != -100].tolist()
        assert labelled == list(ex.answer)
        # position p-1 (the SEP input) predicts the first answer token
        assert ids[i, len(ex.prompt) - 1] == task.SEP
    model = TinyBamba(tiny_sort_config())
    assert model(ids).shape == (*ids.shape, task.VOCAB_SIZE)


@pytest.fixture
def one_thread():
    """Small batched forwards run ~8x slower with 2 threads on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _ablated_accuracy(ablate) -> float:
    model = TinyBamba(_config())
    model.load_state_dict(load_file(str(MODEL / "model.safetensors")))
    with torch.no_grad():
        ablate(model)
    return evaluate(model, task.heldout(50))["accuracy"]


def _forget_ssm_state(model: TinyBamba) -> None:
    # A = -e^30: the state decays to zero after every token, leaving only the conv window and D skip
    for layer in model.model.layers:
        if hasattr(layer, "mamba"):
            layer.mamba.A_log.fill_(30.0)


def test_model_needs_both_attention_and_recurrent_state(one_thread):
    assert _ablated_accuracy(lambda m: None) >= 0.99
    attn = [layer for layer in TinyBamba(_config()).model.layers if hasattr(layer, "self_attn")]
    assert attn, "the model must have an attention layer"
    no_attention = _ablated_accuracy(
        lambda m: [layer.self_attn.o_proj.weight.zero_() for layer in m.model.layers if hasattr(layer, "self_attn")])
    no_state = _ablated_accuracy(_forget_ssm_state)
    assert no_attention <= 0.5 and no_state <= 0.5, (no_attention, no_state)
