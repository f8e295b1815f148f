"""Runtimes start actors and the supervisor watches them.

``base.py`` is the seam (``Runtime``, ``ActorHandle``); ``local.py`` runs actors as child
processes (``child.py`` is their entry point); ``supervisor.py`` turns exits and silence
into ``ActorDied`` / ``ActorHung`` with the evidence; ``topology.py`` assigns endpoints;
``dryrun.py`` drives ``asyncrl train --dry-run``.
"""
