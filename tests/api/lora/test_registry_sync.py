"""Two AdapterRegistry instances on one SQLite database, as two API server processes of one
server (--api-server-count) or two replicas hold them: an adapter loaded or unloaded through
one is served or dropped by the other at its next read of the table, under the same
lora_int_id (the engine core keys slots, CPU cache and prefix-cache hashes by it); one
unloaded and loaded again under its name gets a new id (the old one's blocks and weights are
never met), also where the other missed the first load; --lora-modules adapters take the same
ids in both; a row whose folder no longer fits is not served."""

from __future__ import annotations

import shutil

from api.db.session import Database
from api.lora.modules import LoRAModule
from api.lora.registry import AdapterRegistry
from engine.args import EngineArgs
from engine.async_engine import AsyncEngine
from tests.engine.lora.lora_testing import make_adapter


async def test_two_registries_agree_through_the_table(tiny_llama_dir, tmp_path):
    db = Database.from_url(f"sqlite+aiosqlite:///{tmp_path / 'tessera.db'}")
    await db.upgrade()
    args = EngineArgs(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=64,
        enable_lora=True, max_lora_rank=16,
    )  # fmt: skip
    engine = await AsyncEngine.create(args.create_engine_config())
    flag = make_adapter(tiny_llama_dir, tmp_path / "flag", r=4, seed=1)
    folder = make_adapter(tiny_llama_dir, tmp_path / "b", r=8, seed=2)
    mine = AdapterRegistry([LoRAModule("flag", str(flag))], db)
    theirs = AdapterRegistry([LoRAModule("flag", str(flag))], db)
    try:
        await mine.start(engine)
        first = await mine.load("b", str(folder))
        await mine.unload("b")
        again = await mine.load("b", str(folder))  # the same name and folder, loaded again
        assert again.lora_int_id != first.lora_int_id
        await theirs.start(engine)  # it never saw the first load
        assert set(theirs.adapters) == {"flag", "b"}
        assert theirs.adapters["b"].lora_int_id == again.lora_int_id
        assert theirs.adapters["flag"].lora_int_id == mine.adapters["flag"].lora_int_id == 1

        owned = await theirs.load("owned", str(folder))  # the other way round
        await mine.refresh()
        assert mine.adapters["owned"].lora_int_id == owned.lora_int_id
        await theirs.unload("owned")
        await mine.refresh()
        assert "owned" not in mine.adapters

        # a row whose folder went away: the other does not serve it
        broken = shutil.copytree(folder, tmp_path / "soon-gone")
        await mine.load("gone", str(broken))
        shutil.rmtree(broken)
        await theirs.refresh()
        assert "gone" not in theirs.adapters and set(theirs.adapters) == {"flag", "b"}
    finally:
        await mine.stop()
        await theirs.stop()
        await engine.shutdown()
        await db.dispose()
