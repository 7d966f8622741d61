"""HF engine: behavior log-probs are those of the distribution actually sampled from."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.train.trainer import collate
from ops import token_logprobs
from protocol import Sample
from rollout_server.engine import GenRequest
from rollout_server.engine_hf import HFEngine


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFEngine(tiny_model_dir, seed=3)


def _prompt(engine, text):
    tok = engine.tokenizer
    return np.array([tok.bos_token_id, *tok.encode(text, add_special_tokens=False)], dtype=np.int32)


def _recompute(engine, prompt, comps, temperature):
    """The learner's view: right-padded batch, ops.token_logprobs at the same temperature."""
    samples = [Sample(f"s{i}", "a", i, len(comps), prompt, c.token_ids, c.logprobs, c.versions, 0.0)
               for i, c in enumerate(comps)]
    bt = collate(samples, engine.pad_id)
    with torch.no_grad():
        logits = engine.model(input_ids=bt.input_ids, attention_mask=bt.attention_mask).logits[:, :-1]
    lp = token_logprobs(logits, bt.targets, temperature=temperature)
    return lp, bt


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behavior_logprobs_match_learner_recompute(engine, temperature):
    # Prompts of different lengths in one batch: the engine pads them; the learner's rows do not.
    prompts = [_prompt(engine, t) for t in ("12+7=", "3+25=", "7=", "123+4567=")]
    assert len({len(p) for p in prompts}) == 3
    out = engine.generate_sync([GenRequest(p, 4, temperature=temperature, max_new_tokens=6) for p in prompts])
    for prompt, comps in zip(prompts, out):
        assert len(comps) == 4
        for c in comps:
            assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
            assert len(c.token_ids) == len(c.logprobs) == len(c.versions) >= 1
            assert (c.versions == engine.version).all()
            assert np.all(c.logprobs <= 0) and np.isfinite(c.logprobs).all()
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == engine.eos_id
            else:
                assert len(c.token_ids) == 6
        lp, bt = _recompute(engine, prompt, comps, temperature)
        assert torch.allclose(lp[bt.mask.bool()], bt.behavior_logprobs[bt.mask.bool()], atol=2e-4)


def test_top_p_logprobs_are_of_the_truncated_distribution(engine):
    prompt = _prompt(engine, "9+9=")
    (comps,) = engine.generate_sync([GenRequest(prompt, 8, top_p=0.5, max_new_tokens=4)])
    lp, bt = _recompute(engine, prompt, comps, 1.0)
    m = bt.mask.bool()
    # Renormalizing over the nucleus can only raise a kept token's probability.
    assert (bt.behavior_logprobs[m] >= lp[m] - 1e-5).all()
    assert (bt.behavior_logprobs[m] > lp[m] + 1e-4).any()


def test_load_weights_changes_outputs_and_version(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, seed=0)
    prompt = _prompt(eng, "1+1=")
    new = {n: torch.randn_like(p) * 0.5 for n, p in eng.model.named_parameters()}
    eng.load_weights(7, new)
    assert eng.version == 7
    for n, p in eng.model.named_parameters():
        assert torch.equal(p, new[n])
    (comps,) = eng.generate_sync([GenRequest(prompt, 2, max_new_tokens=3)])
    assert all((c.versions == 7).all() for c in comps)
    with pytest.raises(ValueError, match="missing"):
        eng.load_weights(8, {k: v for k, v in list(new.items())[1:]})
    assert eng.version == 7


def test_rows_of_one_prompt_share_its_prefill(engine):
    """A prompt's n rows (and another request with the same prompt) are prefilled once: the
    first forward of a decode runs one row per distinct prompt, the decode steps every row; the
    log-probs are still the learner's recompute of each row."""
    a, b = _prompt(engine, "12+7="), _prompt(engine, "3+25=")
    batch_rows: list[int] = []
    hook = engine.model.register_forward_pre_hook(
        lambda mod, args, kwargs: batch_rows.append(int(kwargs["input_ids"].shape[0])), with_kwargs=True)
    try:
        out = engine.generate_sync([GenRequest(a, 3, max_new_tokens=4), GenRequest(b, 2, max_new_tokens=4),
                                    GenRequest(a.copy(), 2, max_new_tokens=4)])
    finally:
        hook.remove()
    assert [len(c) for c in out] == [3, 2, 2]
    assert batch_rows[0] == 2 and set(batch_rows[1:]) <= {7}, batch_rows      # prefill: 2 prompts
    for prompt, comps in zip((a, b, a), out):
        lp, bt = _recompute(engine, prompt, comps, 1.0)
        assert torch.allclose(lp[bt.mask.bool()], bt.behavior_logprobs[bt.mask.bool()], atol=2e-4)


def test_a_seeded_assignment_gives_the_same_completions_whatever_else_runs(engine):
    """issue 27.9 (groundwork): SamplingParams.seed: each completion of a seeded request is drawn
    from a generator of its own, so the request alone decides its tokens: the same in another
    batch, after other draws, in another order; another seed gives others."""
    a, b = _prompt(engine, "12+7="), _prompt(engine, "123+4567=")
    seeded = GenRequest(a, 4, temperature=1.0, max_new_tokens=8, seed=11)
    alone = engine.generate_sync([seeded])[0]
    torch.manual_seed(999)                                   # the process RNG moved on
    engine.generate_sync([GenRequest(b, 3, max_new_tokens=8)])
    crowd = engine.generate_sync([GenRequest(b, 2, max_new_tokens=8), seeded,
                                  GenRequest(b, 5, max_new_tokens=8, seed=12)])[1]
    assert [c.token_ids.tolist() for c in crowd] == [c.token_ids.tolist() for c in alone]
    np.testing.assert_allclose(np.concatenate([c.logprobs for c in crowd]),
                               np.concatenate([c.logprobs for c in alone]), rtol=1e-5, atol=1e-5)
    other = engine.generate_sync([GenRequest(a, 4, temperature=1.0, max_new_tokens=8, seed=12)])[0]
    assert [c.token_ids.tolist() for c in other] != [c.token_ids.tolist() for c in alone]
    assert len({tuple(c.token_ids.tolist()) for c in alone}) > 1       # the 4 rows differ


def test_the_seeded_draw_is_the_categorical_distribution():
    """The inverse-CDF draw samples the same distribution torch.multinomial does."""
    from rollout_server.engine_hf import seeded_draw

    probs = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0]])
    gens = [torch.Generator().manual_seed(i) for i in range(20000)]
    draws = torch.cat([seeded_draw(probs, [g]) for g in gens])
    freq = torch.bincount(draws, minlength=5).double() / len(draws)
    assert torch.allclose(freq, probs[0].double(), atol=0.012), freq             # ~3.5 sd of 0.0035
    assert int(draws.max()) <= 3                                                 # never a zero-probability token


def first_completing_string(tok, rows: list[list[int]]) -> tuple[int, int, str]:
    """(row, cut, text): a two-character string whose first occurrence in a row's decoding is
    completed by its token ``cut - 1`` (cut >= 2), so a stop on it keeps ``row[:cut]``."""
    for r, row in enumerate(rows):
        for cut in range(2, len(row)):
            text = tok.decode(row[:cut], skip_special_tokens=False)
            want = text[-2:]
            if len(want) == 2 and want not in tok.decode(row[:cut - 1], skip_special_tokens=False):
                return r, cut, want
    raise AssertionError(f"no row of {rows} has a string to stop on")


def test_stop_strings_and_ids_end_a_completion_with_the_stopping_token_kept(engine):
    """issue 26.3: a seeded request stopped by a string or an id gives the unstopped run's tokens up
    to and including the one that completes it (finish_reason stop); the behavior log-probs of
    what is kept are the unstopped run's too."""
    prompt = _prompt(engine, "12+7=")
    free = engine.generate_sync([GenRequest(prompt, 3, max_new_tokens=12, seed=5)])[0]
    r, cut, want = first_completing_string(engine.tokenizer, [c.token_ids.tolist() for c in free])
    row = free[r].token_ids.tolist()
    by_text = engine.generate_sync([GenRequest(prompt, 3, max_new_tokens=12, seed=5, stop=(want,))])[0]
    assert by_text[r].token_ids.tolist() == row[:cut] and by_text[r].finish_reason == "stop"
    np.testing.assert_allclose(by_text[r].logprobs, free[r].logprobs[:cut], rtol=1e-5, atol=1e-5)
    # An id: the row ends at its first occurrence.
    tid = row[1]
    by_id = engine.generate_sync([GenRequest(prompt, 3, max_new_tokens=12, seed=5, stop_token_ids=(tid,))])[0]
    for c, f in zip(by_id, free):
        full = f.token_ids.tolist()
        end = full.index(tid) + 1 if tid in full else len(full)
        assert c.token_ids.tolist() == full[:end], (c.token_ids, full)
        assert c.finish_reason == ("stop" if tid in full or f.finish_reason == "stop" else "length")
        assert len(c.versions) == len(c.logprobs) == len(c.token_ids)
