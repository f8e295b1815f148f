"""Runtimes start actors and the supervisor watches them.

``base.py`` is the seam (``Runtime``, ``ActorHandle``, ``open_runtime``, ``place_job``);
``local.py`` runs actors as child processes (``child.py`` is their entry point), forked
from a zygote that imported torch once (``zygote.py``, ``forks.py``);
``ray.py`` runs them as Ray actors, placed by their roles' resources; ``supervisor.py``
turns exits and silence into ``ActorDied`` / ``ActorHung`` with the evidence and applies
the restart policy; ``topology.py`` names actors and who binds which endpoint;
``tether.py`` ties a launched server to its actor's life; ``dryrun.py`` drives
``asyncrl train --dry-run``.
"""
