import re
import xml.etree.ElementTree as ElementTree

from paritylab.reports.plots import heatmap, line_chart


def test_line_chart_places_points_on_a_log_scale_and_escapes_labels():
    svg = line_chart([("<layers> & co", [(0, 1e-8), (1, 1e-4), (2, 1e-2)], False)], "title", "layer")
    root = ElementTree.fromstring(svg)  # well-formed XML: the label was escaped
    assert "<layers> & co" in "".join(root.itertext())
    ys = [float(c.get("cy")) for c in root.iter("{http://www.w3.org/2000/svg}circle")]
    assert ys[0] > ys[1] > ys[2]  # larger errors are higher up
    assert abs((ys[0] - ys[1]) / (ys[1] - ys[2]) - 2) < 0.01  # 4 decades vs 2 decades: log scale


def test_heatmap_colours_small_values_pale_and_large_values_dark():
    svg = heatmap(["a.0", "a.1"], ["rel_l2"], [[-12.0], [0.0]], "t")
    fills = re.findall(r'<rect x="\d+" y="\d+" width="90" height="16" fill="(#[0-9a-f]{6})"', svg)
    assert fills == ["#fcfdbf", "#000004"]
    ElementTree.fromstring(svg)
