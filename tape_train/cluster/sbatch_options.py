"""sbatch's long options, and which one a name given to `--sbatch-arg` stands for.

sbatch reads its options (the command line's and the script's `#SBATCH` lines alike) with
getopt_long, which takes any unambiguous prefix of a long option for the option itself:
`--sig=B:USR1@5` is `--signal`, `--no-req` is `--no-requeue`, `--dep=afterok:1` is
`--dependency`. Checks on an option given to tape-submit must therefore look at the option a
name stands for, not at its spelling.

The table is the union of sbatch's long options in Slurm 22.05 to 25.11 (the entries of
`common_options[]` in src/common/slurm_opt.c that sbatch takes). A prefix of one option of
the union is a prefix of at most that one option in each of those versions; one of several is
refused here even where an older sbatch has only one of them. A site's SPANK plugins add
options of their own, which no table here can know: a name that is none of these options and
a prefix of none is left to sbatch.
"""

from __future__ import annotations

SBATCH_LONG_OPTIONS = frozenset("""
account acctg-freq array autocomplete batch bb bbf begin chdir cluster cluster-constraint
clusters comment consolidate-segments constraint container container-id context contiguous
core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task deadline delay-boot dependency
distribution error exclude exclusive export export-file external extra extra-node-info
get-user-env gid gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task gres
gres-flags help hint hold ignore-pbs input job-name kill-on-invalid-dep licenses mail-type
mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu mincpus network nice no-kill
no-requeue nodefile nodelist nodes ntasks ntasks-per-core ntasks-per-gpu ntasks-per-node
ntasks-per-socket ntasks-per-tres oom-kill-step open-mode output overcommit oversubscribe
parsable partition power prefer priority profile propagate qos quiet reboot requeue
reservation resources resv-ports segment signal sockets-per-node spread-job spread-segments
stepmgr switches tasks-per-node test-only thread-spec threads-per-core time time-min tmp
tres-bind tres-per-task uid usage use-min-nodes verbose version wait wait-all-nodes wckey wrap
""".split())

# The options that take a value (getopt's required_argument), as sbatch 22.05 reads them
# (measured: `#SBATCH --<option>` alone is "option requires an argument" there). Given
# without `=value` in an #SBATCH line, such an option takes the next #SBATCH line's argument
# for its value: `--comment` then `--exclusive` gave comment `--exclusive`, no --exclusive.
# Options added after 22.05 are not here (left to sbatch).
SBATCH_OPTIONS_WITH_ARGUMENT = frozenset("""
account acctg-freq array batch bb bbf begin chdir cluster cluster-constraint clusters comment
constraint container context core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task
deadline delay-boot dependency distribution error exclude export export-file extra
extra-node-info gid gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task gres
gres-flags hint input job-name kill-on-invalid-dep licenses mail-type mail-user mcs-label mem
mem-bind mem-per-cpu mem-per-gpu mincpus network nodefile nodelist nodes ntasks ntasks-per-core
ntasks-per-gpu ntasks-per-node ntasks-per-socket ntasks-per-tres open-mode output partition
power prefer priority profile qos reservation signal sockets-per-node switches tasks-per-node
thread-spec threads-per-core time time-min tmp uid wait-all-nodes wckey wrap
""".split())

# Second names of one option (the same entry of getopt's table but for the name).
SBATCH_OPTION_ALIASES = {"tasks-per-node": "ntasks-per-node"}


class AmbiguousOption(ValueError):
    """A name that abbreviates several sbatch options; ``candidates`` are their names."""

    def __init__(self, name: str, candidates: list[str]):
        self.name, self.candidates = name, candidates
        super().__init__(f"--{name} abbreviates several sbatch options: "
                         f"{', '.join('--' + c for c in candidates)}")


def sbatch_long_option(name: str) -> str | None:
    """The sbatch option the long option ``name`` (without its dashes) stands for, as
    getopt_long reads it: ``name`` itself when it is one, else the one option it is a prefix
    of; an alias gives the option it stands for. None when it is none of them and a prefix of
    none (a SPANK plugin's option, or one sbatch will refuse). Raises AmbiguousOption when it
    is a prefix of several."""
    if name in SBATCH_LONG_OPTIONS:
        return SBATCH_OPTION_ALIASES.get(name, name)
    candidates = sorted(option for option in SBATCH_LONG_OPTIONS if option.startswith(name))
    if len(candidates) > 1:
        raise AmbiguousOption(name, candidates)
    if not candidates:
        return None
    return SBATCH_OPTION_ALIASES.get(candidates[0], candidates[0])
