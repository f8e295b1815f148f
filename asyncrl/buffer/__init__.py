"""The buffer: prompt data in, versioned groups out (``docs/design.md`` section 5).

Plain synchronous classes, no sockets: ``versioned.VersionedBuffer`` composes the parts,
and ``asyncrl.actors.buffer.BufferActor`` drives it.
"""
