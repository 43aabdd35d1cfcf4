"""DSpark's and DFlash's ``speculative_config`` keys."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.spec_decode.options import option

VERIFY_MODES = ("full", "threshold", "auto")
DRAFT_DTYPES = ("auto", "float32", "bfloat16", "float16")
DRAFT_QUANTIZATIONS = ("auto", "none", "int8", "int4")


@dataclass(frozen=True)
class DSparkOptions:
    model: str | None = option(None, "the drafter's checkpoint (default: the one shipped for the default model)")
    num_speculative_tokens: int | None = option(None, "drafts per step (default: the drafter's block)", lo=1, hi=32)
    draft_sample_method: str = option("greedy", "'greedy' drafts, or 'probabilistic': sampled from the corrected "
                                      "distribution", choices=("greedy", "probabilistic"))
    dspark_verify: str = option("full", "'full': every draft verified; 'threshold': up to the first confidence "
                                "below confidence_threshold; 'auto': as many as the cost model finds worth",
                                choices=VERIFY_MODES)
    confidence_threshold: float = option(0.5, "dspark_verify='threshold': the confidence cut", lo=0.0, hi=1.0)
    markov_replicate: bool = option(True, "the Markov head replicated on every tensor-parallel rank (else sharded)")
    dspark_tree: int | str | None = option(None, "None: a chain; 'auto': trees sized per step by the cost model; "
                                           "N: trees of N nodes", choices=("auto",), lo=1,
                                           expect="None, 'auto' or a node count >= 1")
    dspark_tree_topk: int = option(4, "trees: candidate tokens per node", lo=1, hi=64)
    dspark_tree_beam: int = option(4, "trees: partial paths kept per depth", lo=1, hi=64)
    online_calibration: bool = option(True, "correct the predicted acceptance by what earlier steps accepted")
    draft_gate: bool = option(True, "'auto' modes: a request whose drafts do not pay sits drafting out a while")
    draft_dtype: str = option("auto", "the drafter's dtype ('auto': bfloat16 where it runs fast)", choices=DRAFT_DTYPES)
    draft_quantization: str = option("auto", "the drafter's weights ('auto': 8 bits beside a quantized target)",
                                     choices=DRAFT_QUANTIZATIONS)

    def __post_init__(self) -> None:
        if self.dspark_tree is None:
            return
        if self.draft_sample_method != "greedy":
            raise ValueError("dspark_tree drafts the top tokens of each node: use draft_sample_method='greedy' "
                             "(tree verification is lossless at any temperature)")
        if self.dspark_verify != "full":
            raise ValueError("dspark_tree chooses the verified nodes itself ('auto' or a size): leave "
                             f"dspark_verify at 'full', got {self.dspark_verify!r}")
