"""Report what a run did: typed facts, the report card's sections, pitfalls and plots.

The names below load on first use (PEP 562): ``dpfy report`` re-renders saved facts without
building anything it does not need.
"""

from __future__ import annotations

from dpfy._lazy import lazy_exports

_EXPORTS = {
    "RunFacts": "dpfy.report.facts",
    "collect_facts": "dpfy.report.facts",
    "render": "dpfy.report.render",
    "render_run": "dpfy.report.render",
    "write_report": "dpfy.report.render",
    "write_session_report": "dpfy.report.session_report",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
