"""ServerState's start-up: an API server of several (`--api-server-count`) attaches to the
parent's engine core before it starts accepting on the shared socket, so a connection the
kernel hands it is never answered "still loading" while the parent already serves. Real
pipes (engine/core_process.core_channel); the core's side is played by closing its ends,
as the parent does when its core failed to load."""

from __future__ import annotations

import asyncio

from api.server.lifespan import Phase, ServerState
from api.server.settings import Settings
from engine.core_process import core_channel


def test_an_attached_server_starts_only_once_the_core_answered(tiny_llama_dir, tmp_path):
    settings = Settings(
        model=str(tiny_llama_dir), auth="none", data_dir=str(tmp_path), device="cpu"
    )
    core_ends, client_ends = core_channel()
    state = ServerState(settings)
    state.core_channel = client_ends

    async def scenario() -> None:
        start = asyncio.create_task(state.start())
        await asyncio.sleep(1.0)
        # the core has not answered: start-up (and so uvicorn's listener) still waits
        assert not start.done() and state.phase is Phase.LOADING
        for end in core_ends:
            end.close()  # the core is gone before it answered
        await asyncio.wait_for(start, 30)

    asyncio.run(scenario())
    assert state.phase is Phase.FAILED
    assert "exited while loading" in state.load_error
