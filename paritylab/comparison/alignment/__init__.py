"""Which candidate call corresponds to which reference call.

Precedence: explicit rules, then identical paths, then automatic alignment of what is left. The
automatic step is a dynamic-programming alignment of the two call sequences (execution order) between
the pairs already fixed, scored on output shape and dtype, output statistics, class and name
similarity, and layer numbers. Rules are data (YAML), litgpt-style: ``{}`` stands for a number, and
``null`` leaves a module unmatched on purpose.

One concept a module: :mod:`._pairs` (a pair and what of its outputs it compares), :mod:`._rules` (rules and
reading them), :mod:`._generalise` (pairs written back as rules), :mod:`._result` (:class:`Alignment`),
:mod:`._shapes` (output shapes that hold the same values), :mod:`._features` (structural evidence),
:mod:`._weight_reads` (the weights each module's code reads), :mod:`._fingerprints` (equal weights),
:mod:`._fused` (parts of fused outputs), :mod:`._runs` (one module against a run of modules),
:mod:`._sequence` (the ordered pass between anchors), :mod:`._rescue` (out-of-order matches) and
:mod:`._align` (:func:`align`: the stages in order).
"""

from __future__ import annotations

from paritylab.comparison.alignment._align import align
from paritylab.comparison.alignment._features import MIN_AUTO_SCORE, MIN_STRUCTURE
from paritylab.comparison.alignment._pairs import Index, Pair, Part, primary_slot
from paritylab.comparison.alignment._rescue import MAX_RESCUE, RESCUE_SCORE
from paritylab.comparison.alignment._result import Alignment
from paritylab.comparison.alignment._rules import AlignmentError, Rule, load_rules, parse_rules
from paritylab.comparison.alignment._runs import MAX_RUN
from paritylab.comparison.alignment._sequence import BAND, MAX_CELLS
from paritylab.comparison.alignment._shapes import broadcastable, in_layout, merged, shapes_fit, transposed

__all__ = [
    "BAND",
    "MAX_CELLS",
    "MAX_RESCUE",
    "MAX_RUN",
    "MIN_AUTO_SCORE",
    "MIN_STRUCTURE",
    "RESCUE_SCORE",
    "Alignment",
    "AlignmentError",
    "Index",
    "Pair",
    "Part",
    "Rule",
    "align",
    "broadcastable",
    "in_layout",
    "load_rules",
    "merged",
    "parse_rules",
    "primary_slot",
    "shapes_fit",
    "transposed",
]
