"""Ending helper tasks: cancel what still runs, then wait until everything has ended.

A task cancelled and never awaited outlives whoever started it (a waiter left pending for the
life of an event loop; a checkpoint task still checkpointing through a closed journal), and a task
that ended with an error nobody read is logged as unretrieved at the loop's end. Every place that
lets go of its helper tasks does both, here.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(*tasks: asyncio.Future[Any]) -> None:
    """Cancel every one of ``tasks`` not yet done, and wait until all have ended, whatever each
    ended with (results and errors are not looked at: whoever needs one reads it from its task)."""
    for task in tasks:
        task.cancel()  # nothing, for one that is done
    await asyncio.gather(*tasks, return_exceptions=True)
