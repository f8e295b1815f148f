"""The buffer: prompt data in, versioned groups out (DESIGN section 6).

Modules:

- ``sources``: reads and validates prompt files (jsonl, parquet) and draws ``Prompt``
  records epoch by epoch, with a checkpointable cursor; owned by the BufferActor.

The store, admission, APRIL and accounting modules come from another engineer.
"""
