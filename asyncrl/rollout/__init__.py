"""Rollout: workflows that turn prompts into scored samples, tools, and the reward scorer.

| module           | what it holds                                                   |
|------------------|-----------------------------------------------------------------|
| ``base``         | ``RolloutContext``, ``Workflow``, ``Generator``, ``RewardFunction`` |
| ``single_turn``  | the reference workflow: one generation, then the reward         |
| ``multi_turn``   | tool use over turns: Hermes calls, masked observations, limits  |
| ``tools/``       | tool registry, calculator, Python sandbox, BM25 search          |
| ``workflows``    | which workflow an actor runs (single, multi-turn, dotted path)  |
| ``rewards``      | the reward scorer: exact, numeric, math, f1, custom, remote        |
"""
