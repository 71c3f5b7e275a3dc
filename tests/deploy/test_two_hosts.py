"""Two real hosts on one machine: two network namespaces joined by a veth pair (each end named ``eth1``,
10.213.0.1 and 10.213.0.2), a Ray head in one and a Ray worker node in the other, each with one CPU.
A model split over both (TP 2, then PP 2) through the Ray executor, its ranks' traffic on ``eth1``,
gives the tokens of one process. Needs root (``ip netns``); marked slow.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared import SamplingParams
from stage5_server import LLM

pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
HEAD, NODE = "10.213.0.1", "10.213.0.2"
ENGINE_KWARGS = dict(max_model_len=128, max_num_seqs=4, block_size=4, max_num_batched_tokens=16, device="cpu",
                     attention_backend="torch", kv_cache_memory=1 << 20)
PROMPTS = ["Hello there, how are", "The quick brown fox jumps over", list(range(3, 25))]
GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)

DRIVER = """
import json, sys
from shared import SamplingParams
from stage5_server import LLM
model, tp, pp, prompts, greedy = json.loads(sys.argv[1])
llm = LLM(model=model, tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="ray",
          distributed_interface="eth1", **json.loads(sys.argv[2]))
tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**greedy), use_tqdm=False)]
nodes = [w["node_id"] for w in llm.engine.model_executor.workers]
llm.shutdown()
print("RESULT " + json.dumps({"tokens": tokens, "nodes": nodes}))
"""

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and ip netns")]


def run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def in_namespace(namespace: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, *argv]


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    suffix = os.getpid()
    a, b = f"ss-a-{suffix}", f"ss-b-{suffix}"
    run("ip", "netns", "add", a)
    run("ip", "netns", "add", b)
    processes = []
    try:
        run("ip", "link", "add", "eth1", "netns", a, "type", "veth", "peer", "name", "eth1", "netns", b)
        for namespace, address in ((a, HEAD), (b, NODE)):
            run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", "eth1")
            run("ip", "-n", namespace, "link", "set", "lo", "up")
            run("ip", "-n", namespace, "link", "set", "eth1", "up")
        # A home of their own: a Ray token file another Ray run left in ~/.ray would turn on token
        # authentication for the head alone, and the driver would be refused.
        home = tmp_path_factory.mktemp("home")
        env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": "", "HOME": str(home)}
        logs = tmp_path_factory.mktemp("ray")
        common = ["--num-cpus", "1", "--block", "--disable-usage-stats"]
        head = in_namespace(a, RAY, "start", "--head", "--node-ip-address", HEAD, "--port", "6379",
                            "--include-dashboard=false", "--temp-dir", f"/tmp/ray-{a}", *common)
        processes.append(subprocess.Popen(head, env=env, stdout=(logs / "head.log").open("w"),
                                          stderr=subprocess.STDOUT))
        time.sleep(8)  # the head's GCS must be up before the node joins it
        node = in_namespace(b, RAY, "start", "--address", f"{HEAD}:6379", "--node-ip-address", NODE,
                            "--temp-dir", f"/tmp/ray-{b}", *common)
        processes.append(subprocess.Popen(node, env=env, stdout=(logs / "node.log").open("w"),
                                          stderr=subprocess.STDOUT))
        yield a, env, logs
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        for namespace in (a, b):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
            shutil.rmtree(f"/tmp/ray-{namespace}", ignore_errors=True)


def split_over_two_hosts(two_hosts, model, tp: int, pp: int) -> dict:
    namespace, env, logs = two_hosts
    args = json.dumps([str(model), tp, pp, PROMPTS, GREEDY])
    command = in_namespace(namespace, sys.executable, "-c", DRIVER, args, json.dumps(ENGINE_KWARGS))
    for _ in range(30):  # until the worker node has joined: a placement then succeeds
        done = subprocess.run(command, env={**env, "RAY_ADDRESS": f"{HEAD}:6379",
                                            "STAGEDSERVE_RAY_PLACEMENT_TIMEOUT": "20"},
                              capture_output=True, text=True, timeout=300, cwd=REPO)
        if done.returncode == 0 or "cannot place" not in done.stderr:
            break
    assert done.returncode == 0, done.stderr[-3000:] + (logs / "node.log").read_text()[-2000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_a_model_split_over_two_hosts_gives_one_process_tokens(two_hosts, tiny_llama, tp, pp):
    expected = [o.outputs[0].token_ids for o in LLM(model=str(tiny_llama), **ENGINE_KWARGS).generate(
        PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)]
    result = split_over_two_hosts(two_hosts, tiny_llama, tp, pp)
    assert len(set(result["nodes"])) == 2  # one rank on each host
    assert result["tokens"] == expected
