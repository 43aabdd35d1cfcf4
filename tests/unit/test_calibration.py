"""Online calibration of the "auto" modes' predicted acceptance (``cost_model.AcceptanceCalibration``):
its arithmetic, and that a drafter whose heads promise more than verification finds verifies less."""

import json

import pytest

from specserve import LLM, SamplingParams
from specserve.spec_decode.cost_model import (AcceptanceCalibration, DraftCosts, DraftGate, StepCosts,
                                              calibrated_lengths, depth_sums, sampling_key)
from specserve.spec_decode.model_drafter import REFRESH_STEPS, ModelDrafter

from test_dspark import write_random_drafter
from test_medusa import make_heads

PROMPTS = [[5, 17, 42, 99, 3], [11, 12], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
G = ("greedy",)


def run_steps(cal, key, predicted, accepted, n, seq_id=1):
    for _ in range(n):
        cal.begin_step([key])
        cal.expect(seq_id, key, predicted)
        cal.observe(seq_id, accepted)


def test_factors_follow_what_verification_accepts():
    cal = AcceptanceCalibration(3, decay=0.98, prior=2.0)
    assert cal.factors(G) == [1.0, 1.0, 1.0]
    # predictions that verification bears out leave them as they are
    run_steps(cal, G, [1.0, 1.0, 1.0], 3, 50)
    assert cal.factors(G) == pytest.approx([1.0, 1.0, 1.0])
    # promised 0.8 / 0.6 / 0.4, never accepted: the factors fall towards 0, never below it, never
    # rising with depth; the (exact) formula of the first one
    hot = (0.7, 0, 1.0, 0.0)
    run_steps(cal, hot, [0.8, 0.6, 0.4], 0, 60)
    f = cal.factors(hot)
    pred = sum(0.8 * 0.98**i for i in range(60))
    assert f[0] == pytest.approx(2.0 / (pred + 2.0))
    assert 0 < f[2] <= f[1] <= f[0] < 0.1
    assert cal.factors(G) == pytest.approx([1.0, 1.0, 1.0])  # settings keep their own statistics
    # promised 0.2 / 0.1, both always accepted: the first factor rises above 1, the second stays below it
    cold = (1.0, 0, 1.0, 0.0)
    run_steps(cal, cold, [0.2, 0.1, 0.0], 2, 60)
    f = cal.factors(cold)
    assert f[0] > 3 and f[1] == f[0]  # depth 2 alone would rise further: capped by depth 1
    assert f[2] == f[1]  # nothing verified at depth 3: no evidence, the factor of depth 2
    # steps that verify nothing decay the evidence: the factors return to 1, so drafting is tried again
    for _ in range(400):
        cal.begin_step([hot])
    assert cal.factors(hot)[0] > 0.95


def test_expectations_are_kept_per_sequence_and_dropped():
    cal = AcceptanceCalibration(2)
    cal.begin_step([G])
    cal.expect(1, G, [0.9, 0.9])
    cal.expect(2, G, [0.0, 0.0])  # nothing verified: nothing to check
    cal.observe(2, 0)
    cal.observe(3, 0)  # no expectation: ignored
    assert cal.factors(G) == [1.0, 1.0] and list(cal._pending) == [1]
    cal.observe(1, 1)  # depth 1 accepted, depth 2 not
    assert not cal._pending
    f = cal.factors(G)
    assert f[0] == pytest.approx(3.0 / 2.9) and f[1] == pytest.approx(2.0 * f[0] / 2.9)
    assert depth_sums([0.5, 0.25, 0.25, 0.1], [1, 1, 2, 3], 2) == [0.75, 0.25]


def test_sampling_key_and_calibrated_lengths():
    class Seq:
        def __init__(self, i, params):
            self.seq_id, self.params = i, params

    greedy, hot = SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9)
    assert sampling_key(greedy) == G and sampling_key(hot) == (0.7, 0, 0.9, 0.0) != sampling_key(
        SamplingParams(temperature=0.7))
    seqs = [Seq(1, greedy), Seq(2, hot)]
    cal = AcceptanceCalibration(3)
    surv = [[0.9, 0.8, 0.7], [0.9, 0.8, 0.7]]
    cost = lambda n: 1.0 + 0.3 * n  # noqa: E731
    assert calibrated_lengths(cal, seqs, surv, cost) == calibrated_lengths(None, seqs, surv, cost) == (
        [3, 3], [pytest.approx(2.4)] * 2)
    for _ in range(40):  # the sampled request's drafts keep failing
        cal.observe(1, 3)
        cal.observe(2, 0)
        lengths, gains = calibrated_lengths(cal, seqs, surv, cost)
    n = lengths[0]
    assert lengths[1] == n > 0  # a batch pads its rows to the longest: the sampled one's drafts come free
    assert gains[1] < 0.5 * sum(surv[1][:n])  # ... and its gains are scaled down
    assert sum(surv[0][:n]) < gains[0] <= n  # the greedy one's, always accepted, scaled up (each capped at 1)
    for s in seqs:  # alone, each request verifies what its own calibrated drafts are worth
        cal.observe(s.seq_id, 3 if s.seq_id == 1 else 0)
    alone = [calibrated_lengths(cal, [s], [row], cost)[0][0] for s, row in zip(seqs, surv)]
    assert alone[0] == 3 and alone[1] < 3


@pytest.mark.parametrize("method", ["medusa-chain", "medusa-tree", "dspark"])
def test_overconfident_drafter_verifies_less_with_calibration(tiny_llama, tmp_path, method):
    """Random heads made sharp (high probabilities for tokens the target rarely samples) at temperature
    1: without the calibration the cost model verifies what they promise; with it, after a few steps,
    much less. The output stays the target's (the distribution tests run with the calibration on)."""
    cfg = json.loads((tiny_llama / "config.json").read_text())
    if method == "dspark":
        spec = {"method": "dspark", "model": str(write_random_drafter(tmp_path / "d", tiny_llama, scale=1.5)),
                "dspark_verify": "auto"}
    else:
        heads = make_heads(tmp_path / "h", cfg["hidden_size"], cfg["vocab_size"], shared=False, scale=3.0)
        spec = {"method": "medusa", "model": str(heads), "medusa_verify": "auto", "medusa_topk": 3,
                "medusa_tree": 8 if method == "medusa-tree" else None, "ngram_branch": 0}
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, ignore_eos=True) for s in range(3)]
    drafted = {}
    for on in (False, True):
        llm = LLM(model=str(tiny_llama), dtype="float32", speculative_config={**spec, "online_calibration": on})
        prop = llm.engine.proposer
        prop.verify_costs = {1: 1.0, 1000: 1.0 + 999 * 0.2}
        assert (prop.calibration is not None) == on
        llm.generate(PROMPTS, params, use_tqdm=False)
        m = llm.get_metrics()
        drafted[on] = m["num_draft_tokens"]
        if on:
            assert not prop.calibration._pending  # every expectation was checked or dropped
            f = prop.calibration.factors(sampling_key(params[0]))
            assert f[0] < 0.8, f
    assert drafted[False] > 0 and drafted[True] < 0.6 * drafted[False], drafted


def test_draft_gate_backs_off_while_drafting_does_not_pay():
    gate = DraftGate(max_backoff=4)
    cost = lambda n: 1.0 + 0.1 * (n - 1)  # noqa: E731  a plain step costs 1, each verified draft 0.1
    assert not gate.skip(7)
    # expected 0.5 tokens for 2 verified drafts, drafting 0.2: 1.5 / (1.2 + 0.2) > 1 / 1: worth it
    assert gate.judge(7, 0.5, 2, cost, 0.2) and not gate.skip(7)
    assert not gate.judge(8, 0.3, 2, cost, 0.2)  # 1.3 / 1.4 < 1
    # expected 0.05 for 1 draft: 1.05 / (1.1 + 0.2) < 1: skip 1 step, then (failing again) 2, 4, 4
    pattern = []
    for _ in range(4):
        assert not gate.judge(7, 0.05, 1, cost, 0.2)
        n = 0
        while gate.skip(7):
            n += 1
        pattern.append(n)
    assert pattern == [1, 2, 4, 4]
    assert gate.judge(7, 1.0, 1, cost, 0.2) and not gate.skip(7)  # a probe that pays resets it
    assert not gate.judge(7, 0.0, 0, cost, 0.2) and gate.skip(7) and not gate.skip(7)
    gate.forget(7)
    assert not gate.skip(7)


def test_draft_costs_rise_to_the_engines_calls_never_fall_below_the_table():
    """The drafting cost the cost models read: the start-up table until ``min_calls`` calls of a batch
    size were timed, then the larger of the table and their running mean (per batch size); a batch size
    the table does not cover takes this step's measurement."""
    costs = DraftCosts(min_calls=3, weight=0.5)
    table = {1: 2.0, 4: 5.0}
    for s in (3.0, 3.0):
        costs.observe(1, s)
    assert costs(table, 1, 9.0) == 2.0  # two calls: still the table
    costs.observe(1, 6.0)  # mean of 3, 3, 6
    assert costs(table, 1, 9.0) == pytest.approx(4.0)
    assert costs(table, 2, 9.0) == pytest.approx(3.0)  # interpolated, no calls of 2 yet
    costs.observe(1, 0.0)  # then exponential: 4 + 0.5 * (0 - 4)
    assert costs(table, 1, 9.0) == 2.0  # 2.0 is the mean now, not below the table either
    costs.observe(1, 0.0)
    assert costs(table, 1, 9.0) == 2.0  # the mean (1.0) below the table: the table
    assert costs(table, 8, 0.7) == 0.7 and costs(None, 1, 0.7) == pytest.approx(1.0)


def test_step_costs_correct_the_table_by_the_engines_steps():
    """Per token count, the running mean of (step time - table), each clipped to -table / 2 .. +table,
    counts once seen ``min_steps`` times; between them linear, from 0 at no tokens up to the first seen,
    flat past the last."""
    costs = StepCosts(min_steps=2, weight=0.5)
    assert costs.corrections(4) == [0.0] * 4
    costs.observe(3, 8.0, 5.0)
    assert costs.corrections(4) == [0.0] * 4  # one step of 3 tokens: not yet
    costs.observe(3, 4.0, 5.0)  # mean of +3 and -1
    assert costs.corrections(6) == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0, 1.0, 1.0])
    costs.observe(6, 60.0, 10.0)  # a pause: +50 clipped to +10 (the table)
    costs.observe(6, 0.0, 10.0)  # -10 clipped to -5
    assert costs.corrections(8) == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0, 1.5, 2.0, 2.5, 2.5])
    costs.observe(3, 9.0, 5.0)  # exponential now: 1 + 0.5 * (4 - 1)
    assert costs.corrections(4)[3] == pytest.approx(2.5)


def test_verify_cost_takes_in_the_engines_steps():
    """``ModelDrafter.verify_cost``: the start-up table until steps were timed, then corrected by them
    (``StepCosts``) every ``REFRESH_STEPS`` steps, never decreasing with the token count nor below half
    the table; the token counts past its list keep the table's growth."""
    d = ModelDrafter()
    d.verify_costs = {1: 4.0, 9: 12.0}
    assert [d.verify_cost(n) for n in (1, 5, 9, 400)] == pytest.approx([4.0, 8.0, 12.0, 12.0 * 400 / 9])
    d.step_cost(3, 100.0)  # no table: nothing learned before one exists
    for _ in range(8):
        d.step_cost(5, 8.0 + 3.0)  # steps of 5 tokens cost 3 more than the table says
        d.step_cost(2, 5.0 - 1.0)  # steps of 2 tokens 1 less
    assert REFRESH_STEPS == 8 and d.verify_cost(5) == pytest.approx(11.0) and d.verify_cost(2) == pytest.approx(4.0)
    assert d.verify_cost(1) == pytest.approx(4.0 - 0.5)  # from 0 at no tokens to -1 at 2
    assert d.verify_cost(3) == pytest.approx(6.0 + 1 / 3) and d.verify_cost(9) == pytest.approx(15.0)
    costs = [d.verify_cost(n) for n in range(1, 40)]
    assert costs == sorted(costs)
    assert d.verify_cost(400) == pytest.approx(12.0 * 400 / 9 + 3.0)
    for _ in range(40):
        d.step_cost(2, 0.0)  # (clipped at half the table)
    assert d.verify_cost(2) >= 0.5 * 5.0


class Seq:
    def __init__(self, temperature=0.0):
        self.params = SamplingParams(temperature=temperature)


def test_expand_threshold_leaves_out_only_nodes_the_cost_model_never_takes():
    """``ModelDrafter.expand_threshold``: half the average cost of a verified draft as a share of a plain
    step over the first ``EXPAND_TOKENS`` drafts a sequence, over the largest calibration factor (0 without
    a cost table). With step costs a + b n ``choose_verify_lengths`` takes no node below b / a whatever
    the scores before it (and takes nodes just above it): the threshold, b / 2a there, leaves out none
    that it takes, with room for costs that are not linear."""
    import random

    from specserve.spec_decode.cost_model import choose_verify_lengths
    from specserve.spec_decode.model_drafter import EXPAND_TOKENS

    d = ModelDrafter()
    assert d.expand_threshold([Seq()]) == 0.0
    a, b = 4.0, 0.6
    d.verify_costs = {1: a, 2: a + b, 100: a + 99 * b}
    t = d.expand_threshold([Seq()])
    assert t == pytest.approx(0.5 * b / a)
    B = 2  # a batch: its verification of B (1 + K) tokens against one of B
    assert d.expand_threshold([Seq(), Seq(0.7)]) == pytest.approx(
        0.5 * (a + b * (B * (1 + EXPAND_TOKENS) - 1) - (a + b)) / (B * EXPAND_TOKENS * (a + b)))
    rng = random.Random(0)
    taken = []
    for _ in range(3000):
        row = sorted((rng.random() ** rng.choice((1, 3, 8)) for _ in range(rng.randint(1, 30))), reverse=True)
        taken += row[: choose_verify_lengths([row], d.verify_cost)[0]]
    assert min(taken) >= b / a > t and min(taken) < 1.05 * b / a
    # calibration factors above 1 scale scores up before the choice: the threshold comes down with them
    d.calibration = AcceptanceCalibration(3)
    run_steps(d.calibration, G, [0.2, 0.1, 0.05], 3, 30)
    top = max(d.calibration.factors(G))
    assert top > 1.5 and d.expand_threshold([Seq()]) == pytest.approx(t / top)
    assert d.expand_threshold([Seq(0.8)]) == pytest.approx(t)  # another setting, no evidence yet


def test_start_up_step_costs_time_long_steps_once_and_are_kept_per_process(tiny_llama, monkeypatch):
    """``measure_step_costs``: every size once untimed, then ``reps`` timed rounds, sizes above
    ``LONG_STEP`` in the first only (and only two of them); the table never falls with n. A second
    engine of the same target and threads reads the first one's table; another thread count measures
    again."""
    import torch

    import specserve.engine.model_runner as mr
    from specserve.engine.model_runner import LONG_STEP, ModelRunner, measure_step_costs, sizes_to_time

    calls = []
    fake = {1: 3.0, 2: 1.0, LONG_STEP + 8: 9.0}  # a noisy 1-token time: the curve must still rise

    def forward(slot, tokens, starts, mode):
        calls.append(len(tokens[0]))
        if mode == "all":
            mr.time.perf_counter.t += fake[len(tokens[0])]

    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    monkeypatch.setattr(mr.time, "perf_counter", Clock())
    costs = measure_step_costs(forward, "cpu", sorted(fake), reps=3)
    assert calls == [128, 1, 2, LONG_STEP + 8] + [1, 2, LONG_STEP + 8] + [1, 2] * 2
    assert costs == {1: 3.0, 2: 3.0, LONG_STEP + 8: 9.0}
    # of the long sizes only the middle and the largest are timed (``interp_cost`` reads the rest off a line)
    calls.clear()
    fake.update({LONG_STEP + 1: 4.0, LONG_STEP + 20: 5.0, LONG_STEP + 40: 6.0})
    costs = measure_step_costs(forward, "cpu", sorted(fake), reps=3)
    assert sorted(costs) == [1, 2, LONG_STEP + 20, LONG_STEP + 40]
    assert set(calls) == {1, 2, 128, LONG_STEP + 20, LONG_STEP + 40}
    assert sizes_to_time([LONG_STEP, 1, LONG_STEP + 5]) == [1, LONG_STEP, LONG_STEP + 5]
    monkeypatch.undo()

    measured = []
    real = mr.measure_step_costs
    monkeypatch.setattr(mr, "measure_step_costs", lambda *a: measured.append(a[2]) or real(*a))
    sizes = [1, 2, 5]
    a = ModelRunner(tiny_llama, dtype="float32").step_costs(sizes)
    b = ModelRunner(tiny_llama, dtype="float32").step_costs(sizes)
    assert measured == [sizes] and a == b and sorted(a) == sizes
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        ModelRunner(tiny_llama, dtype="float32").step_costs(sizes)
    finally:
        torch.set_num_threads(threads)
    assert measured == [sizes, sizes]


def test_engine_reports_one_sequence_steps_to_the_proposer(tiny_llama):
    """Every decoding step of a lone sequence reports how many tokens it verified and what the step cost
    without drafting; a step of a batch of several reports nothing."""
    llm = LLM(model=str(tiny_llama), dtype="float32", speculative_config={"method": "ngram",
                                                                          "num_speculative_tokens": 3})
    seen = []
    llm.engine.proposer.step_cost = lambda n, s: seen.append((n, s))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], params, use_tqdm=False)
    steps = llm.engine.stats.decode_steps
    assert len(seen) == steps and all(1 <= n <= 4 and 0 < s < 5 for n, s in seen)
    assert sum(n for n, _ in seen) == llm.engine.stats.verified_tokens
    seen.clear()
    llm.generate([[5, 6, 7, 8], [9, 10, 11, 12]], params, use_tqdm=False)
    assert len(seen) < llm.engine.stats.decode_steps - steps  # the steps the two shared report nothing


def _count_drafting(prop, drafted: list[int]) -> None:
    """Count into ``drafted[0]`` the sequences ``prop`` drafts for: DSpark's drafting calls, or the
    Medusa heads' forwards."""
    if prop.name == "medusa":
        logits = prop.heads.logits

        def counting(hidden, lm_head, emb=None, _logits=logits):
            drafted[0] += hidden.shape[0]
            return _logits(hidden, lm_head, emb)

        prop.heads.logits = counting
        return
    helper = prop.target.call_helper

    def counting_calls(name, method, *args, _helper=helper):
        if method in ("propose", "propose_tree"):
            drafted[0] += len(args[0])
        return _helper(name, method, *args)

    prop.target.call_helper = counting_calls


@pytest.mark.parametrize("mode", [{"dspark_verify": "auto"}, {"dspark_tree": "auto"}, {"method": "medusa"}])
def test_draft_gate_stops_costly_drafting_that_does_not_pay(tiny_llama, tmp_path, mode):
    """A random drafter whose drafting costs as much as a target step (DSpark's "auto" modes, Medusa's
    dynamic trees): with the gate, most steps do not draft at all; without it (or with drafting for
    free) every step drafts. Greedy output unchanged."""
    if mode.get("method") == "medusa":
        cfg = json.loads((tiny_llama / "config.json").read_text())
        heads = make_heads(tmp_path / "h", cfg["hidden_size"], cfg["vocab_size"], shared=False, scale=3.0)
        spec, per_token = {"method": "medusa", "model": str(heads), "medusa_topk": 3}, 0.001
    else:
        drafter = write_random_drafter(tmp_path / "d", tiny_llama)
        spec, per_token = {"method": "dspark", "model": str(drafter), "ngram_branch": 0, **mode}, 0.05
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=str(tiny_llama), dtype="float32").generate(
        PROMPTS, params, use_tqdm=False)]
    share = {}
    for gate, draft_cost in ((True, 1.0), (False, 1.0), (True, 0.0)):
        llm = LLM(model=str(tiny_llama), dtype="float32", speculative_config={**spec, "draft_gate": gate})
        prop = getattr(llm.engine.proposer, "inner", llm.engine.proposer)  # (inside n-gram branches)
        assert (prop.gate is not None) == gate
        prop.verify_costs = {1: 1.0, 1000: 1.0 + 999 * per_token}
        prop.draft_costs = {1: draft_cost, 4: draft_cost}
        drafted = [0]  # sequences that drafted, summed over steps
        _count_drafting(prop, drafted)
        out = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == plain
        share[(gate, draft_cost)] = drafted[0] / llm.get_metrics()["num_verify_steps"]
    # (the last step of each sequence has no draft budget)
    assert share[(False, 1.0)] > 0.85 and share[(True, 0.0)] > 0.85, share
    assert share[(True, 1.0)] < 0.5, share
