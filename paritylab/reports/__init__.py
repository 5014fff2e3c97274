"""Reports: a compared report rendered for people (console, markdown, JSON, HTML, SVG plots).

Imports only :mod:`paritylab.comparison` and :mod:`paritylab.tracing`.
"""
