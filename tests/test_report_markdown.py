"""``report.md`` is plain markdown: module names in code spans, shown as written (``<root>``, never
``&lt;root&gt;``); other text keeps HTML out (MLflow renders descriptions) in a way both GitHub's markdown and
MLflow's show as the characters."""

from __future__ import annotations

import paritylab
from paritylab.reports.render import _md_escape, to_markdown
from tests.test_api_drilldown import X, pair


def test_report_md_names_modules_as_written(tmp_path):
    reference, candidate = pair(0.51)
    result = paritylab.check(reference, candidate, tmp_path, reference_call=lambda m: m(X), echo=None)
    text = to_markdown(result.report)
    assert "Origins: `block`" in text
    assert "| 0 | `<root>` | `<root>` | compared | fail | contains-origin |" in text
    assert "| 3 | `block.fc` | `block.fc` | compared | pass |" in text
    assert "&lt;" not in text.split("| # |", 1)[1]  # the table: names in code spans, no entities
    assert "inside block: the floating-point inputs agree, then mul(tanh[3, 4], 0.51) differs" in text
    assert _md_escape("<script>x</script> a|b `c`") == "&lt;script&gt;x&lt;/script&gt; a\\|b 'c'"
