"""Tensor parallelism on CUDA (skipped without a GPU): a group of one on NCCL with the
profiled KV budget; two ranks on two GPUs, each on its own device, tokens equal to TP=1."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.distributed import backend_for, bind_cuda_device, destroy_distributed, init_distributed
from engine.worker.model_runner import ModelRunner, resolve_device

pytest.importorskip("msgspec")  # the TP step payload's; a GPU machine's image may lack it
from engine.worker.multiproc import free_port  # noqa: E402

pytestmark = pytest.mark.cuda


def test_tp1_on_nccl_and_the_profiled_kv_budget(tiny_llama_dir):
    device = resolve_device("auto")
    assert device == torch.device("cuda", 0) and backend_for(device) == "nccl"
    bind_cuda_device(device)
    init_distributed(0, 1, f"tcp://127.0.0.1:{free_port()}", backend_for(device), timeout_s=60)
    try:
        assert dist.get_backend() == "nccl"
        t = torch.full((4,), 3.0, device=device)
        dist.all_reduce(t)
        assert t.tolist() == [3.0] * 4
        config = EngineConfig(
            model=ModelConfig(
                model=str(tiny_llama_dir), dtype="float32", device="auto", max_model_len=256
            ),
            cache=CacheConfig(gpu_memory_utilization=0.5),
            scheduler=SchedulerConfig(
                max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256
            ),
        )
        runner = ModelRunner(config, model_dir=tiny_llama_dir)
        runner.load_model()
        assert runner.device_info() == ("cuda:0", 0)
        num_blocks = runner.determine_num_blocks()
        free, total = torch.cuda.mem_get_info(device)
        # Half the device, less what is in use now: never more than that, and a real share.
        assert 0 < num_blocks * runner.kv_block_bytes() <= total * 0.5 - (total - free)
        assert num_blocks * runner.kv_block_bytes() > total * 0.5 - (total - free) - (1 << 30)
    finally:
        destroy_distributed()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_places_each_rank_on_its_own_gpu(tiny_llama_dir):
    from engine import LLM, SamplingParams

    prompts = [list(range(10, 40)), [3, 9, 27, 81]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    results = []
    for tp in (1, 2):
        llm = LLM(
            str(tiny_llama_dir),
            dtype="float32",
            num_kv_blocks=64,
            block_size=16,
            max_model_len=128,
            tensor_parallel_size=tp,
            device="cuda",
        )
        try:
            if tp == 2:
                group = llm.engine.executor.workers
                assert group.backend == "nccl"
                mine, theirs = group._call("device_info")
                assert mine == ("cuda:0", 0) and theirs == [("cuda:1", 1)]
            outs = llm.generate(prompts, params, use_tqdm=False)
            results.append([o.outputs[0].token_ids for o in outs])
        finally:
            llm.shutdown()
    assert results[0] == results[1]
