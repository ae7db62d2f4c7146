"""RequestStream: a slot holding the newest cumulative output, the finished one last."""
from __future__ import annotations

import asyncio

from guided.outputs import RequestOutput
from guided.serving.request_stream import RequestStream


def test_stream_keeps_only_the_latest_output_and_the_finished_one_last():
    def output(n, finished=False):
        return RequestOutput("s", [1], list(range(n)), "x" * n, finished=finished)

    async def main():
        aborted = []
        owner = type("Owner", (), {"abort": lambda self, rid: aborted.append(rid)})()
        stream = RequestStream("s", owner, asyncio.get_running_loop())
        stream._deliver(output(1))
        stream._deliver(output(2))
        first = await stream.__anext__()
        waiting = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        stream._deliver(output(3, finished=True))
        stream._deliver(output(4))  # nothing replaces a finished output
        rest = [await waiting] + [o async for o in stream]
        stream.abort()  # finished: a no-op
        return first, rest, aborted

    first, rest, aborted = asyncio.run(main())
    assert len(first.token_ids) == 2
    assert [len(o.token_ids) for o in rest] == [3] and rest[0].finished
    assert aborted == []
