"""One typed config tree for a job, loaded from a preset, a YAML file and ``--flag`` values.

Every leaf's flag is its YAML key, dotted (``rollout.num_actors`` is
``--rollout.num-actors``), and slime's names are aliases (``docs/design.md`` section 8).
Components own their sections; ``RunConfig`` composes them. Every problem becomes one line
of a single ``ConfigError``, raised before any process starts (``load_config``).
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
from asyncrl.config.loading import Overrides, config_changes, dump_resolved, load_config
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
    "EVERYDAY",
    "PRESETS",
    "SLIME_FLAGS",
    "ConfigError",
    "FlagSpec",
    "KeyConflict",
    "LogConfig",
    "Overrides",
    "RayConfig",
    "RayRole",
    "RunConfig",
    "RuntimeConfig",
    "Section",
    "TrainConfig",
    "add_arguments",
    "config_changes",
    "config_reference",
    "debug_cpu",
    "dump_resolved",
    "everyday",
    "flag_table",
    "key_flag",
    "load_config",
    "metavar",
    "normal_flag",
    "overrides_from_namespace",
]
