"""One typed config tree for a job, loaded from a preset, a YAML file and ``--flag`` values.

Precedence, lowest first: section defaults, a preset (a function in ``PRESETS``), the YAML
file, then flags (a later flag beats an earlier one). One vocabulary: every leaf's flag is
its YAML key, dotted, ``--`` in front: ``seed`` is ``--seed``, ``rollout.num_actors`` is
``--rollout.num-actors`` (``--rollout.num_actors`` too: ``_`` and ``-`` are the same in a
flag). slime's names for the same concept are aliases (``--rollout-batch-size`` is
``--buffer.groups-per-step``; ``SLIME_FLAGS``, or a field's
``json_schema_extra={"flag": ..., "aliases": [...]}``). A field typed as a pydantic model
is a section; anything else is a leaf. Every flag takes a value, read as JSON, then YAML
(``--seed 3``, ``--x "[1, 2]"``, ``--x true``), except for string leaves, which keep it
verbatim (``--name 007``). ``docs/config.md`` lists every key (``config_reference``).

From argparse: ``add_arguments`` registers each flag with ``default=argparse.SUPPRESS``,
``overrides_from_namespace`` returns what the user typed as ``{"--flag": "text"}``, and
``load_config`` takes that mapping or a ``["--flag", "value", "--flag=value"]`` list.

Every problem becomes one line of a single ``ConfigError``, raised before any process
starts: unknown keys and flags get a did-you-mean, bad values name key, flag, expectation
and value, and values from the file name file and line. Called by the CLI; from the
validated tree the job builds each actor's own settings (``actors/config.py``).
Components own their sections; ``RunConfig`` composes.

Modules: ``run`` (``RunConfig``, presets), ``sections`` (runtime, log, train, Ray; the
errors), ``flags`` (the flag vocabulary, argparse, ``docs/config.md``), ``loading``
(``load_config``, YAML, error lines).
"""

from asyncrl.config.flags import (
    EVERYDAY,
    SLIME_FLAGS,
    FlagSpec,
    add_arguments,
    config_reference,
    everyday,
    flag_table,
    key_flag,
    metavar,
    normal_flag,
    overrides_from_namespace,
)
from asyncrl.config.loading import Overrides, dump_resolved, load_config
from asyncrl.config.run import PRESETS, RunConfig, debug_cpu
from asyncrl.config.sections import (
    ConfigError,
    KeyConflict,
    LogConfig,
    RayConfig,
    RayRole,
    RuntimeConfig,
    Section,
    TrainConfig,
)

__all__ = [
    "EVERYDAY", "PRESETS", "SLIME_FLAGS", "ConfigError", "FlagSpec", "KeyConflict",
    "LogConfig", "Overrides", "RayConfig", "RayRole", "RunConfig", "RuntimeConfig",
    "Section", "TrainConfig", "add_arguments", "config_reference", "debug_cpu",
    "dump_resolved", "everyday", "flag_table", "key_flag", "load_config", "metavar",
    "normal_flag", "overrides_from_namespace",
]  # fmt: skip
