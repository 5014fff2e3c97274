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


def _fills(svg: str) -> list[str]:
    return re.findall(r'<rect x="\d+" y="\d+" width="90" height="16" fill="(#[0-9a-f]{6})"', svg)


def test_a_tolerance_relative_heatmap_is_calm_within_tolerance_and_alarming_over_it():
    """A rounding-level error (1e-8 against a 1.3e-6 tolerance) and one just under the tolerance are greens; one
    just over it is orange, a thousand times over it dark red. The bar marks where the tolerance sits."""
    import math

    ratios = [1e-8 / 1.3e-6, 0.9, 1.1, 1000.0]
    svg = heatmap([f"a.{n}" for n in range(4)], ["rel_l2"], [[math.log10(r)] for r in ratios], "t", relative=True)
    calm, edge, over, far = (tuple(int(f[i : i + 2], 16) for i in (1, 3, 5)) for f in _fills(svg))
    assert all(green > red and green > blue for red, green, blue in (calm, edge))  # greens
    assert over[0] > 240 and over[1] > 150 and over[2] < 90  # orange
    assert far == (103, 0, 13)  # dark red at the scale's top
    assert "tolerance" in "".join(ElementTree.fromstring(svg).itertext())
    assert "1.1× tolerance" in svg  # each cell says its ratio


def test_the_own_error_chart_shows_the_layer_that_holds_the_bug(tmp_path):
    """A x1.05 down-projection in layer 1 of 3: the isolated replay's own error of every layer is 0 (its code
    between its children is the reference's); the layer fed the reference's input and run whole shows 1e-3 at
    layer 1 and nothing elsewhere, in the report's rows, the depth chart's metric and the heatmap's colours."""
    import copy

    import paritylab
    from paritylab.reports.plots import own_error, write_plots
    from paritylab.sink.dashboard import report_metrics
    from tests.tiny import tiny_llama, token_ids

    reference = tiny_llama(num_hidden_layers=3)
    candidate = copy.deepcopy(reference)
    candidate.model.layers[1].mlp.down_proj.register_forward_hook(lambda _m, _a, out: out * 1.05)
    ids = token_ids()
    result = paritylab.check(reference, candidate, tmp_path, reference_call=lambda m: m(ids))
    assert result.report.first_divergence.path == "model.layers.1.mlp.down_proj"
    layers = {row.path: row for row in result.report.rows if re.fullmatch(r"model\.layers\.\d", row.path)}
    assert [layers[f"model.layers.{n}"].local["local_rel_l2"] for n in range(3)] == [0.0, 0.0, 0.0]
    own = [own_error(layers[f"model.layers.{n}"]) for n in range(3)]
    assert own[0] == 0.0 and own[2] < 1e-6 and 5e-4 < own[1] < 2e-3
    depth = {m.step: m.value for m in report_metrics(result.report) if m.key == "depth/model.layers/log10_own_rel_l2"}
    assert max(depth, key=depth.get) == 1 and depth[1] > -3.5 and depth[0] < -11
    svg = (write_plots(result.report, tmp_path / "plots")[1]).read_text()
    own_cells = _fills(svg)[3::4]  # the own-error column, one cell per layer
    (r0, g0, _), (r1, g1, _) = (tuple(int(cell[i : i + 2], 16) for i in (1, 3, 5)) for cell in own_cells[:2])
    assert g0 > r0 and r1 > g1 + 50  # layer 0 calm (green), layer 1 alarming (orange: twice what it may show)
