"""Actors: long-running processes that own their state and talk only through channels.

    DataSource -> buffer --work (rpc)-------------> rollout-i --HTTP--> engines
                    ^  <--results (reliable, acked)--'    ^
                    |                                     | weights (pub/sub + blob pull)
                    '--batches (rpc)--> trainer ----------'

| actor      | consumes                         | produces                        |
|------------|----------------------------------|---------------------------------|
| buffer     | results from rollout actors      | work items, train batches       |
| rollout-i  | work items, weight versions      | results (groups of samples)     |
| trainer    | train batches                    | weight versions                 |
| engine-i   | HTTP calls of rollout-i, weights | generations (``serve: actor``)  |
| eval       | weight versions                  | pass@k rows                     |
| reward     | pairs from rollout-i and eval    | reward-model scores             |
| controller | heartbeats, Bye                  | commands (stop, pause, resume)  |

Each actor waits only on its channels: a rollout actor for credits for work, the trainer
for a batch, the buffer never (it answers as its state allows). ``base.py`` holds the
lifecycle every actor follows; the controller (``asyncrl/job.py``) is not an actor.
"""
