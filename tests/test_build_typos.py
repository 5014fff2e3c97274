"""A typo of a builder's argument (``model.build.layrs=2``) names the argument meant, with or without ``+``."""

from __future__ import annotations

import pytest

from paritylab.run.config import check_target
from paritylab.run.errors import ConfigError


def test_a_typo_of_a_build_key_says_what_was_meant(capsys):
    from paritylab.cli.app import preflight

    with pytest.raises(SystemExit) as exited:
        preflight(["model.build.layrs=2", "tracking=off"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "paritylab: bad configuration: model.build.layrs is not set (did you mean model.build.layers?); a new "
        "argument is added with +model.build.layrs=<value> (model.build takes any key)"
    )
    with pytest.raises(SystemExit):
        preflight(["model.build.depth=2", "tracking=off"])  # nothing close: a new argument, added with +
    assert "model.build.depth is not set yet: add it with +model.build.depth=<value>" in capsys.readouterr().err


def test_an_added_build_key_the_builder_does_not_take_says_what_was_meant():
    node = {"_target_": "paritylab.run.references.llava", "layrs": 2}
    with pytest.raises(ConfigError, match=r"takes no argument 'layrs' \(did you mean layers\?\); it takes: pre"):
        check_target("model.build", node)


@pytest.mark.parametrize("override", ["candidate.build.scale=1", "+candidate.build.scale=1"])
def test_a_key_under_a_section_that_is_null_here_says_where_it_goes(capsys, override):
    """``candidate=port`` builds through ``candidate.ports.<family>.build``; its ``candidate.build`` is null, and
    OmegaConf said only "Unexpected type for root: NoneType"."""
    from paritylab.cli.app import preflight

    with pytest.raises(SystemExit) as exited:
        preflight(["model=llava", "candidate=port", override, "tracking=off"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "paritylab: bad configuration: candidate.build.scale cannot be set: candidate.build is null in this "
        "configuration: set candidate.ports.llava.build.scale instead (see the keys with --cfg job)"
    )
