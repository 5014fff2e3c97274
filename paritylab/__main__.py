"""``python -m paritylab model=llava candidate=port``: the parity run as a Hydra app."""

from __future__ import annotations

import os
import re
import sys

import hydra
from omegaconf import DictConfig

from paritylab.cli.app import CONF_DIR, exit_code, exit_process, preflight, record, take_profile_flag
from paritylab.run.config import register

register()
_task_started = False
"""Whether Hydra has called the task (a job ran here): an exception before that, and before a sweep started, is
Hydra's own (a bad override)."""


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    from paritylab.run.runner import run
    from paritylab.sink.interrupts import EXIT_INTERRUPTED
    from paritylab.sink.sweep import sweep_state

    global _task_started
    _task_started = True
    code = run(cfg).exit_code
    record(code)
    if code == EXIT_INTERRUPTED and sweep_state() is not None:
        raise KeyboardInterrupt  # stop the sweep: no job after an interrupted one


def entry() -> None:
    """The ``paritylab`` console script (same as ``python -m paritylab``). ``--profile[=FILE]`` (before the
    overrides) writes a cProfile of the whole process to FILE (default ``paritylab.prof``)."""
    import paritylab
    from paritylab.run.config import one_line
    from paritylab.sink.interrupts import EXIT_INTERRUPTED, signals_ignored, sigterm_as_interrupt
    from paritylab.sink.sweep import finish_sweep, sweep_started

    paritylab.FROM_COMMAND_LINE = True
    profile = take_profile_flag(sys.argv)
    if profile is not None:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    preflight(sys.argv[1:])
    own_errors = "HYDRA_FULL_ERROR" not in os.environ  # Hydra then raises its errors here instead of exiting 1
    if own_errors:
        os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        with sigterm_as_interrupt():
            main()
    except KeyboardInterrupt:  # a sweep between jobs, or Hydra's own code: a single run handles it itself
        with signals_ignored():
            swept = sweep_started()
            finish_sweep(interrupted=True)
        if swept:
            print("paritylab: interrupted; finished jobs are kept, the sweep's parent run is KILLED", file=sys.stderr)
        else:
            print("paritylab: interrupted while starting; nothing was compared", file=sys.stderr)
        exit_process(EXIT_INTERRUPTED)
    except Exception as error:
        if not own_errors or not hydra_error(error):
            raise
        message = re.sub(r"; To append to your config use \S+", "", one_line(error))  # Hydra's + is no fix here
        if "hydra." in message:  # Hydra's own settings are listed by --cfg hydra
            message = message.replace("--cfg job", "--cfg hydra")
        print(f"paritylab: bad configuration: {message}", file=sys.stderr)
        exit_process(2)
    code = max(exit_code(), finish_sweep())
    if profile is not None:
        profiler.disable()
        profiler.dump_stats(profile)
        print(f"paritylab: profile written to {profile} (read it with: python -m pstats {profile})")
    exit_process(code)


def hydra_error(error: BaseException) -> bool:
    """Whether ``error`` is Hydra's refusal of the command line (an override it rejects, a launcher's unknown key),
    not a failure in a job: said in one line with exit 2, as paritylab's own configuration errors are."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from paritylab.sink.sweep import sweep_started

    return isinstance(error, HydraException | OmegaConfBaseException) or not (_task_started or sweep_started())


if __name__ == "__main__":
    entry()
