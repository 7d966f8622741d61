"""Each sample is recomputed at the temperature it was sampled at, so ``ctl set temperature`` is
safe while older samples are still buffered: intake stamps the assignment's temperature into the
typed ``Sample.sampling_temperature`` (protocol 3.3), collate reads it, the log-prob function
groups rows by it, and a mixed batch trains exactly like the row-by-row reference."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from learner_testkit import samples_for
from test_trainer import B, assert_close_dicts, grads, make_batch, make_trainer, reference

import protocol
from buffer import RolloutBuffer
from learner.metrics import LearnerMetrics
from learner.models.forward import row_temperature_groups
from learner.serve.intake import Intake
from learner.train.batching import collate, sampling_temperature

TEMPS = [0.5, 1.0, 0.5, 1.0, 2.0, 2.0, 1.0, 0.5]      # per row of test_trainer's batch


def stamped(batch, temps):
    for s, t in zip(batch.samples, temps, strict=True):
        s.sampling_temperature = t
    return batch


def test_groups_of_rows():
    assert row_temperature_groups(0.7, 3) == [(0.7, None)]
    assert row_temperature_groups(torch.full((3,), 0.7), 3) == [(pytest.approx(0.7), None)]
    groups = row_temperature_groups(torch.tensor([1.0, 0.5, 1.0]), 3)
    assert [(t, idx.tolist()) for t, idx in groups] == [(0.5, [1]), (1.0, [0, 2])]
    with pytest.raises(ValueError, match="2 row temperatures for 3 rows"):
        row_temperature_groups(torch.ones(2), 3)


def test_collate_reads_the_stamp_and_falls_back_to_the_run_temperature():
    batch = make_batch()
    s = batch.samples
    s[0].sampling_temperature = 0.25
    s[1].metadata = {"sampling_temperature": 0.5}       # a 3.2-style metadata key: not read
    for other in s[1:]:
        assert other.sampling_temperature is None         # no stamp: the run's own
    bt = collate(s, 0, temperature=0.8)
    assert bt.temperatures.tolist() == pytest.approx([0.25, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8])
    assert sampling_temperature(s[0], 1.0) == 0.25
    assert bt.rows(torch.tensor([0, 4])).temperatures.tolist() == pytest.approx([0.25, 0.8])
    assert bt.select(torch.tensor([0, 0])).temperatures.tolist() == pytest.approx([0.25, 0.25])


@pytest.mark.parametrize("hidden", [True, False])
def test_row_temperatures_equal_one_call_per_row(tiny_model_dir, hidden):
    """log-probs, entropies and their gradients of a mixed-temperature batch equal those of each
    row computed alone at its own temperature (both paths: hidden state and logits)."""
    tr = make_trainer(tiny_model_dir)
    tr.forward.uses_hidden = hidden
    bt = collate(stamped(make_batch(), TEMPS).samples, tr.pad_id)
    lp, ent = tr.forward(bt.input_ids, bt.attention_mask, bt.targets, bt.temperatures, entropy="grad")
    ((lp + ent) * bt.mask).sum().backward()             # padding columns are no row's business
    mixed = grads(tr)
    tr.model.zero_grad()
    for i, tau in enumerate(TEMPS):
        row = bt.rows(torch.tensor([i]))
        lp_i, ent_i = tr.forward(row.input_ids, row.attention_mask, row.targets, tau, entropy="grad")
        width = row.targets.shape[1]
        torch.testing.assert_close(lp[i, :width], lp_i[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[i, :width], ent_i[0], atol=1e-5, rtol=0)
        ((lp_i + ent_i) * row.mask).sum().backward()
    assert_close_dicts(grads(tr), mixed, atol=1e-4, rtol=1e-4)
    # One temperature for all rows, as a tensor: the scalar call's numbers, bit for bit.
    same, _ = tr.forward(bt.input_ids, bt.attention_mask, bt.targets, torch.full((B,), 0.5))
    scalar, _ = tr.forward(bt.input_ids, bt.attention_mask, bt.targets, 0.5)
    assert torch.equal(same, scalar)


def test_mixed_temperature_step_matches_the_row_by_row_reference(tiny_model_dir):
    tr = make_trainer(tiny_model_dir, micro_batch_samples=3)
    batch = stamped(make_batch(), TEMPS)
    ref_loss, _, _, ref_grads = reference(tiny_model_dir, batch, tr.cfg)
    wrong_loss, _, _, _ = reference(tiny_model_dir, make_batch(), tr.cfg)   # all at the run's 1.0
    assert abs(wrong_loss - ref_loss) > 1e-3                  # the temperatures matter here
    stats = tr.step(batch)
    assert stats["loss"] == pytest.approx(ref_loss, abs=1e-5)
    assert_close_dicts(grads(tr), ref_grads, atol=1e-5, rtol=1e-4)


def test_behavior_at_each_rows_temperature_has_no_mismatch(tiny_model_dir):
    """Behavior log-probs from the policy itself, each row at its sampling temperature: the
    importance weights are 1 and mismatch KL 0. Recomputed at one temperature, they are not."""
    probe = make_trainer(tiny_model_dir)
    batch = stamped(make_batch(), TEMPS)
    bt = collate(batch.samples, probe.pad_id)
    with torch.no_grad():
        lp, _ = probe.forward(bt.input_ids, bt.attention_mask, bt.targets, bt.temperatures)
    for i, s in enumerate(batch.samples):
        p, t = len(s.prompt_token_ids), len(s.completion_token_ids)
        s.behavior_logprobs = lp[i, p - 1:p - 1 + t].numpy().astype(np.float32)
    stats = make_trainer(tiny_model_dir).step(batch)
    assert stats["mismatch_kl"] == pytest.approx(0.0, abs=1e-6)
    assert stats["is_weight_min"] == pytest.approx(1.0, abs=1e-5)
    assert stats["is_weight_max"] == pytest.approx(1.0, abs=1e-5)
    for s in batch.samples:
        s.sampling_temperature = None                           # as if the stamp were ignored
    assert make_trainer(tiny_model_dir).step(batch)["mismatch_kl"] > 1e-3


def test_intake_stamps_the_learners_temperature_over_the_servers():
    buf = RolloutBuffer(batch_samples=2, group_size=2, max_staleness=3)
    a = protocol.Assignment(assignment_id="a1", prompt_id="p", prompt_token_ids=np.array([1, 7, 9], np.int32),
                            group_size=2, version=0, sampling=protocol.SamplingParams(temperature=0.3))
    buf.issue("a1", "s", 2, payload=a)
    intake = Intake(buf, vocab_size=50, sampling=SimpleNamespace(max_new_tokens=16), version=lambda: 1,
                    metrics=LearnerMetrics())
    samples = samples_for(a, version=0, sampling_temperature=1e-6, metadata={"other": 1})  # a lie
    intake.stamp(samples[0])
    assert samples[0].sampling_temperature == 0.3 and samples[0].metadata == {"other": 1}
    # No assignment of the learner's (the lease is gone): no temperature from the server either.
    stray = samples_for(a, version=0, sampling_temperature=1e-6)[1]
    stray.assignment_id = "gone"
    intake.stamp(stray)
    assert stray.sampling_temperature is None


def test_intake_takes_a_samples_dataset_from_its_assignment_never_from_the_server():
    """A server that names a dataset of a mixture itself (to skew the per-dataset statistics, or
    outside any mixture) is not believed: the assignment's name replaces it, and without one it
    is removed; the server's other metadata stays."""
    buf = RolloutBuffer(batch_samples=4, group_size=2, max_staleness=3)
    mixed = protocol.Assignment(assignment_id="a1", prompt_id="p", prompt_token_ids=np.array([1, 7, 9], np.int32),
                                group_size=2, version=0, metadata={protocol.DATASET_KEY: "facts"})
    plain = protocol.Assignment(assignment_id="a2", prompt_id="p", prompt_token_ids=np.array([1, 7, 9], np.int32),
                                group_size=2, version=0)
    buf.issue("a1", "s", 2, payload=mixed)
    buf.issue("a2", "s", 2, payload=plain)
    intake = Intake(buf, vocab_size=50, sampling=SimpleNamespace(max_new_tokens=16), version=lambda: 1,
                    metrics=LearnerMetrics())
    lie = {protocol.DATASET_KEY: "arith", "other": 1}
    s1 = samples_for(mixed, version=0, metadata=dict(lie))[0]
    s2 = samples_for(plain, version=0, metadata=dict(lie))[0]
    intake.stamp(s1)
    intake.stamp(s2)
    assert s1.metadata == {protocol.DATASET_KEY: "facts", "other": 1}
    assert s2.metadata == {"other": 1}
