"""The buffer: prompt data in, versioned groups out (``docs/design.md`` section 5).

Plain classes, no sockets; ``asyncrl.actors.buffer.BufferActor`` drives them.

- ``sources``: reads and validates prompt files (jsonl, parquet) and draws ``Prompt``
  records epoch by epoch, with a checkpointable cursor.
- ``admission``: rule (1), how many groups may be admitted at trainer version ``v``.
- ``accounting``: the ledger; every admitted group is in exactly one state.
- ``store``: finished groups by head version, with priorities, an age guarantee, the
  staleness backstop and bounded reuse.
- ``filters``: dynamic-sampling filters (zero reward variance, custom).
- ``april``: the pool of aborted or requeued groups that resume first.
- ``versioned``: ``VersionedBuffer``, composing all of the above, with its config,
  statistics and checkpoint record.
"""
