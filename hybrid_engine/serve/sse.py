"""Server-sent events as the OpenAI streaming API sends them: `data: {json}` per chunk, then
`data: [DONE]`; and the response that streams them."""

from __future__ import annotations

import json
from collections.abc import Callable

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse

DONE = "data: [DONE]\n\n"


def event(chunk: BaseModel | dict) -> str:
    body = chunk.model_dump_json() if isinstance(chunk, BaseModel) else json.dumps(chunk, ensure_ascii=False)
    return f"data: {body}\n\n"


class EventStreamResponse(StreamingResponse):
    """A StreamingResponse that notices a client leaving at once. Starlette watches for the
    disconnect only under ASGI < 2.4; otherwise it learns of it at the next write, which for a
    request still in its prefill may be long after. Here the watch always runs, and when either
    side ends, on_close() is called (it aborts the engine requests) and the events are closed.

    on_close is called here, not from the event generator's `finally`: a generator that never
    started (the first send raised, the task was cancelled first) runs no `finally` on aclose()."""

    def __init__(self, events, on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:   # the client went away between two writes
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self.on_close()
            await self.body_iterator.aclose()
