"""Rollout: workflows that turn prompts into scored samples, and the reward hub.

| module           | what it holds                                                   |
|------------------|-----------------------------------------------------------------|
| ``base``         | ``RolloutContext``, ``Workflow``, ``Generator``, ``RewardFunction`` |
| ``single_turn``  | the reference workflow: one generation, then the reward         |
| ``rewards``      | the reward hub: exact, numeric, math, f1, custom, remote        |
"""
