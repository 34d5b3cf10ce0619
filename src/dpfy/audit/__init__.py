"""Empirical privacy auditing: evidence about the code that ran, beside the ε it claims.

An ε is a proof about the mechanism as written; an audit runs the code with canaries (or
attacks the final model) and turns what an attacker could tell into a lower bound ε̂ at a stated
confidence (Nasr et al. 2023; Steinke, Nasr & Jagielski 2023). A correct run has ε̂ ≤ ε.
"""

from __future__ import annotations

from dpfy._lazy import lazy_exports

#: Names loaded on first use (PEP 562), so the torch-free bounds import without torch.
_LAZY = {
    "StepSettings": "dpfy.audit.observe",
    "audit_private_step": "dpfy.audit.whitebox",
    "audit_user_model": "dpfy.audit.user_model",
    "fdp_audit": "dpfy.audit.fdp",
    "insert_canaries": "dpfy.audit.blackbox",
    "score_canaries": "dpfy.audit.blackbox",
}


__getattr__ = lazy_exports(__name__, _LAZY)
