"""The file backend: the embedded default for one machine and for offline replay.

``frames`` is the on-disk frame format, ``segments`` the segment log (commits, torn tails,
damage), ``snapshots`` the snapshot generations (compaction, lost generations), ``durable``
the durable writes they make; ``backend.FileBackend`` composes them.
"""
