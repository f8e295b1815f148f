"""What several subcommands' parsers share: where a job's config comes from, and
``--help-all``."""

from __future__ import annotations

import argparse

KEYS_HELP = (
    "Every config key is also a flag: rollout.num_actors is --rollout.num-actors (slime's "
    "names work too, e.g. --rollout-batch-size). Flags win over the YAML file, which wins "
    "over the preset. --help shows the everyday keys; --help-all shows all of them; "
    "docs/config.md lists each with its default."
)


def add_job_source(parser: argparse.ArgumentParser) -> None:
    """Where a job's config comes from: a YAML file and a preset (flags come on top)."""
    parser.add_argument("config", nargs="?", help="YAML config file")
    parser.add_argument("--preset", help="start from a named preset (e.g. debug_cpu)")


def add_help_all(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--help-all", action="help", help="show every config key, not only the everyday ones"
    )
