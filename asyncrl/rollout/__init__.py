"""Rollout: workflows that turn prompts into scored samples, their tools, and the reward scorer.

``base`` is the seam every workflow stands on (``RolloutContext``, ``Workflow``);
``docs/design.md`` maps the modules.
"""
