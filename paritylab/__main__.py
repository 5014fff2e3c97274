"""``python -m paritylab model=llava candidate=port``: the parity run as a Hydra app."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from paritylab.cli.app import CONF_DIR, exit_code, exit_process, preflight, record, take_profile_flag
from paritylab.run.config import register

register()


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    from paritylab.run.runner import run
    from paritylab.sink.interrupts import EXIT_INTERRUPTED
    from paritylab.sink.sweep import sweep_state

    code = run(cfg).exit_code
    record(code)
    if code == EXIT_INTERRUPTED and sweep_state() is not None:
        raise KeyboardInterrupt  # stop the sweep: no job after an interrupted one


def entry() -> None:
    """The ``paritylab`` console script (same as ``python -m paritylab``). ``--profile[=FILE]`` (before the
    overrides) writes a cProfile of the whole process to FILE (default ``paritylab.prof``)."""
    import paritylab
    from paritylab.sink.interrupts import EXIT_INTERRUPTED, signals_ignored, sigterm_as_interrupt
    from paritylab.sink.sweep import finish_sweep

    paritylab.FROM_COMMAND_LINE = True
    profile = take_profile_flag(sys.argv)
    if profile is not None:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    preflight(sys.argv[1:])
    try:
        with sigterm_as_interrupt():
            main()
    except KeyboardInterrupt:  # a sweep between jobs, or Hydra's own code: a single run handles it itself
        with signals_ignored():
            finish_sweep(interrupted=True)
        print("paritylab: interrupted; finished jobs are kept, the sweep's parent run is KILLED", file=sys.stderr)
        exit_process(EXIT_INTERRUPTED)
    code = max(exit_code(), finish_sweep())
    if profile is not None:
        profiler.disable()
        profiler.dump_stats(profile)
        print(f"paritylab: profile written to {profile} (read it with: python -m pstats {profile})")
    exit_process(code)


if __name__ == "__main__":
    entry()
