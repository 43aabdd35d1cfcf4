"""Medusa's ``speculative_config`` keys."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.spec_decode.options import option

VERIFY_MODES = ("full", "auto")


@dataclass(frozen=True)
class MedusaOptions:
    model: str | None = option(None, "the heads' checkpoint (default: the heads shipped for the default model)")
    num_speculative_tokens: int | None = option(None, "heads used per step (default: all of the checkpoint's)",
                                                lo=1, hi=32)
    medusa_tree: int | str | list | None = option(
        None, "None: a chain of each head's top token; 'auto': a tree sized by the cost model (chosen every step "
        "with medusa_verify='auto'); N: a tree of the N likeliest nodes; or a list of rank paths",
        choices=("auto",), lo=1, expect="None, 'auto', a node count >= 1 or a list of rank paths")
    medusa_topk: int = option(10, "candidate tokens per head", lo=1, hi=64)
    acceptance: str = option("exact", "'exact' (lossless) or 'typical' (Medusa's LOSSY typical acceptance)",
                             choices=("exact", "typical"))
    posterior_threshold: float = option(0.09, "typical acceptance: the probability threshold", lo=0.0, hi=1.0)
    posterior_alpha: float = option(0.3, "typical acceptance: the entropy-scaled threshold's factor", lo=0.0, hi=1.0)
    medusa_verify: str = option("full", "'full': every draft verified; 'auto': the cost model chooses how many",
                                choices=VERIFY_MODES)
    online_calibration: bool = option(True, "correct the predicted acceptance by what earlier steps accepted")
    draft_gate: bool = option(True, "dynamic trees ('auto' tree and verify): a request whose drafts do not pay sits "
                              "the heads out a while")
