"""A streaming request whose client goes away leaves nothing waiting behind it.

The gateway waits for a call's first token, then for each next chunk, each time on a helper
future beside the call's task. A request cancelled meanwhile (the client disconnected) must take
its helper with it: a helper left waiting on the queue for good is one leaked task per
disconnected request, and one that outlives its request could take a chunk nobody reads."""

from __future__ import annotations

import asyncio

from rollout_journal.participants.remote.gateway.app import _Chunks, _drain, _first_event


async def _pending_besides(*known: asyncio.Task) -> list[str]:
    await asyncio.sleep(0)  # what was cancelled has had its step
    me = asyncio.current_task()
    return sorted(t.get_name() for t in asyncio.all_tasks() if t is not me and t not in known and not t.done())


def test_a_request_cancelled_before_its_first_token_leaves_no_waiter() -> None:
    async def scenario() -> list[str]:
        call = asyncio.create_task(asyncio.sleep(3600), name="the model call")
        waiting = asyncio.create_task(_first_event(_Chunks(), call), name="request")
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        left = await _pending_besides(call)
        call.cancel()
        return left

    assert asyncio.run(scenario()) == []


def test_a_stream_cancelled_between_chunks_leaves_no_getter_and_loses_no_chunk() -> None:
    async def scenario() -> tuple[list[str], int]:
        queue = _Chunks()
        call = asyncio.create_task(asyncio.sleep(3600), name="the model call")

        async def read_one() -> None:
            async for _ in _drain(queue, call):
                pass

        reading = asyncio.create_task(read_one(), name="request")
        await asyncio.sleep(0.01)
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        left = await _pending_besides(call)
        queue.put_nowait("chunk")  # type: ignore[arg-type]  # an orphaned getter would take it
        await asyncio.sleep(0)
        call.cancel()
        return left, queue.qsize()

    assert asyncio.run(scenario()) == ([], 1)
