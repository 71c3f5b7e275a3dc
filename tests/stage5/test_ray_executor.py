"""The Ray executor on a local two-node Ray cluster (Ray's own ``cluster_utils``: two raylets on this
machine, one CPU each): the ranks of a split model placed one per node, the same tokens as one
process, and a clear error when the cluster cannot place the ranks.
"""

from __future__ import annotations

import pytest

from shared import SamplingParams
from stage5_server import LLM
from stage5_server.executor.ray_executor import PLACEMENT_TIMEOUT_ENV, RayExecutor
from tests.stage5.server_fixtures import wait_until

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

ENGINE_KWARGS = dict(max_model_len=128, max_num_seqs=4, block_size=4, max_num_batched_tokens=16, device="cpu",
                     attention_backend="torch", kv_cache_memory=1 << 20)
PROMPTS = ["Hello there, how are", "The quick brown fox jumps over", list(range(3, 25))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def two_nodes():
    cluster = cluster_utils.Cluster(initialize_head=True,
                                    head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return token_ids(LLM(model=str(tiny_llama), **ENGINE_KWARGS).generate(PROMPTS, GREEDY, use_tqdm=False))


def test_two_ranks_on_two_nodes_give_one_process_tokens(two_nodes, tiny_llama, expected):
    llm = LLM(model=str(tiny_llama), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_KWARGS)
    try:
        executor = llm.engine.model_executor
        assert isinstance(executor, RayExecutor)
        assert len({w["node_id"] for w in executor.workers}) == 2  # one bundle of one CPU per node
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    finally:
        llm.shutdown()
    assert wait_until(lambda: ray.available_resources().get("CPU") == 2, timeout=30)  # the group was given back


def test_a_cluster_too_small_is_refused_with_what_it_has(two_nodes, tiny_llama, monkeypatch):
    monkeypatch.setenv(PLACEMENT_TIMEOUT_ENV, "3")
    with pytest.raises(ValueError, match=r"cannot place 4 workers of \{'CPU': 1\} within 3 s .*it has 2 CPU"):
        LLM(model=str(tiny_llama), tensor_parallel_size=2, pipeline_parallel_size=2,
            distributed_executor_backend="ray", **ENGINE_KWARGS)
    assert wait_until(lambda: ray.available_resources().get("CPU") == 2, timeout=30)


def test_unknown_backend_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="distributed_executor_backend: must be 'mp' or 'ray', got 'mpi'"):
        LLM(model=str(tiny_llama), distributed_executor_backend="mpi", **ENGINE_KWARGS)


@pytest.mark.slow
def test_two_pipeline_stages_on_two_nodes_give_one_process_tokens(two_nodes, tiny_llama, expected):
    llm = LLM(model=str(tiny_llama), pipeline_parallel_size=2, distributed_executor_backend="ray", **ENGINE_KWARGS)
    try:
        workers = llm.engine.model_executor.workers
        assert [w["stage"] for w in workers] == [0, 1] and len({w["node_id"] for w in workers}) == 2
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    finally:
        llm.shutdown()
