"""The speculation gate: per kind of batch (size; greedy or sampled), draft while steps with drafts emit
tokens faster than steps without; back off where they do not, probing now and then (less often while
the choice stands); the output never changes."""

import time
from types import SimpleNamespace

import pytest

from conftest import SHIPPED_SPECULATION_GATE

from specserve import LLM, SamplingParams
from specserve.entrypoints.cli import build_parser
from specserve.engine.spec_gate import SpeculationGate


def test_gate_measures_both_then_takes_the_faster_and_probes():
    for cap, probes in ((256, [4, 12, 28, 60]), (8, [4, 12, 20, 28, 36, 44, 52, 60])):
        g = SpeculationGate(probe_every=4, warmup=1, max_probe_every=cap)
        assert g.draft(2)  # measures drafting first
        g.record(2, True, 10, 1.0)
        assert not g.draft(2)  # then a plain step
        g.record(2, False, 20, 1.0)
        choices = [g.draft(2) for _ in range(60)]
        # plain is twice as fast: a step of drafting after 4 steps, then twice as long after each probe, up
        # to the cap
        assert [i + 1 for i, c in enumerate(choices) if c] == probes, cap
        for _ in range(20):  # drafting became faster (say, the batch shrank its costs): the gate follows
            g.record(2, True, 60, 1.0)
        assert [g.draft(2) for _ in range(8)] == [True] * 3 + [False] + [True] * 4  # and probes soon again
    steady = SpeculationGate(probe_every=4, warmup=1, keep_probing=lambda key: key == 2)
    for key in (2, 3):
        steady.record(key, True, 10, 1.0)
        steady.record(key, False, 20, 1.0)
    assert [i + 1 for i in range(24) if steady.draft(2)] == [4, 8, 12, 16, 20, 24]  # probed every 4 steps
    assert [i + 1 for i in range(24) if steady.draft(3)] == [4, 12]
    assert g.rates(3) == (None, None) and g.draft(3)  # another batch size starts over
    with pytest.raises(ValueError, match="probe_every"):
        SpeculationGate(probe_every=1)
    with pytest.raises(ValueError, match="max_probe_every"):
        SpeculationGate(probe_every=16, max_probe_every=8)


def test_engine_backs_off_a_drafter_that_does_not_pay(tiny_llama):
    """A drafter made slow on purpose: with the gate most steps go without drafts, the text is plain
    decoding's; without it every step drafts."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompt = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4]]  # n-gram matches from the start
    plain = LLM(model=str(tiny_llama), dtype="float32").generate(prompt, params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    steps = {}
    for gate in (False, True):
        llm = LLM(model=str(tiny_llama), dtype="float32", speculative_config=spec, speculation_gate=gate)
        slow = llm.engine.proposer.propose

        def propose(inputs, slow=slow):
            time.sleep(0.02)  # costs far more than the tiny model's step
            return slow(inputs)

        llm.engine.proposer.propose = propose
        out = llm.generate(prompt, params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
        steps[gate] = (llm.engine.stats.decode_steps, llm.get_metrics()["num_drafts"])
    (_, drafted_off), (_, drafted_on) = steps[False], steps[True]
    assert drafted_off >= 12, steps  # the n-gram drafter has drafts in many steps of its own
    assert drafted_on <= drafted_off / 3, steps  # with the gate, in few: its measurements and probes
    with pytest.raises(TypeError, match="speculation_gate must be true or false"):
        LLM(model=str(tiny_llama), speculation_gate="yes")


def test_greedy_and_sampled_batches_keep_rates_of_their_own(tiny_llama):
    """The engine keys the gate by batch size and whether every request is greedy: sampled requests
    (fewer drafts accepted) never move the rates greedy batches of the same size are decided by."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    llm = LLM(model=str(tiny_llama), dtype="float32", speculative_config=spec, speculation_gate=True)
    prompt = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4]]
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    gate = llm.engine.gate
    greedy = gate.rates((1, True))
    assert None not in greedy and gate.rates((1, False)) == (None, None)
    llm.generate(prompt, SamplingParams(temperature=0.9, seed=3, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert gate.rates((1, True)) == greedy and None not in gate.rates((1, False))
    rows = [SimpleNamespace(params=SamplingParams(temperature=t)) for t in (0, 0.7, 0)]
    assert llm.engine.gate_key(rows) == (3, False) and llm.engine.gate_key(rows[::2]) == (2, True)
    # single greedy requests keep probing often; sampled requests and batches back off
    assert gate.keep_probing((1, True)) and not gate.keep_probing((1, False)) and not gate.keep_probing((4, True))


def test_the_gate_is_on_by_default(tiny_llama, monkeypatch):
    """``LLM``, ``generate``/``serve`` and the bench run the gate unless told otherwise (the test suite
    pins it off for every other test: ``conftest._speculation_gate_off``)."""
    assert SHIPPED_SPECULATION_GATE is True
    monkeypatch.setattr("specserve.config.SPECULATION_GATE", SHIPPED_SPECULATION_GATE)
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    assert LLM(model=str(tiny_llama), dtype="float32", speculative_config=spec).engine.gate is not None
    off = LLM(model=str(tiny_llama), dtype="float32", speculative_config=spec, speculation_gate=False)
    assert off.engine.gate is None
    parser = build_parser()
    for argv in (["generate", "--prompt", "x"], ["serve"], ["bench"]):
        assert parser.parse_args(argv).speculation_gate == "on", argv
    assert parser.parse_args(["bench", "--speculation-gate", "off"]).speculation_gate == "off"
