"""The weight ledger: every candidate parameter and buffer matched to the reference's, before any activation.

The commonest porting bug lives in a weight: a conversion that scales, slices, transposes or maps a tensor wrongly,
a table built from a wrong constant. Fingerprints (:mod:`paritylab.tracing.structure`) say which tensors hold the
same values; this module says what the others are: for each candidate tensor whose values no reference tensor
holds, the reference tensor it is nearest (from the row and column sums each fingerprint keeps), and what differs
(one element, a scale, rows, a table's ratio). No map is written: tensors are matched on values alone, so a port
with other names, fused or split projections, or a transposed layout is read as it is.

The ledger feeds the alignment (a module whose weights are near the reference's is paired with it, however its
code names it: the bug its weights carry must not cost it its pair) and the report (the finding is printed where
divergence starts).
"""

from __future__ import annotations

from paritylab.comparison.weights._exact import line_order
from paritylab.comparison.weights._ledger import as_twins, weight_ledger
from paritylab.comparison.weights._records import (
    NEAR,
    NEAR_NAMESAKE,
    ROUNDING,
    UNIQUE,
    Held,
    WeightFinding,
    WeightLedger,
    held,
)
from paritylab.comparison.weights._rows import RowBlock, row_blocks

__all__ = [
    "NEAR",
    "NEAR_NAMESAKE",
    "ROUNDING",
    "UNIQUE",
    "Held",
    "RowBlock",
    "WeightFinding",
    "WeightLedger",
    "as_twins",
    "held",
    "line_order",
    "row_blocks",
    "weight_ledger",
]
