"""``python -m paritylab model=llava candidate=port``: the parity run as a Hydra app."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from paritylab.cli import CONF_DIR, exit_code, exit_process, preflight, record
from paritylab.config import register

register()


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    from paritylab.runner import run

    record(run(cfg).exit_code)


def entry() -> None:
    """The ``paritylab`` console script (same as ``python -m paritylab``)."""
    from paritylab.sweep import finish_sweep

    preflight(sys.argv[1:])
    main()
    exit_process(max(exit_code(), finish_sweep()))


if __name__ == "__main__":
    entry()
