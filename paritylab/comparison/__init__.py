"""Comparison: two traces aligned, measured and judged; where divergence starts.

Alignment across implementations (:mod:`.alignment`), divergence metrics and tolerances (:mod:`.metrics`), the
compared report and its one culprit (:mod:`.report`), isolated replay (:mod:`.replay`) and the operation
drill-down (:mod:`.drilldown`). Imports only :mod:`paritylab.tracing`.
"""
