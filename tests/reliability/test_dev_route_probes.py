"""The dev routes (``--enable-dev-routes``) probed as a careless operator would use them: an RPC that waits on
the network (joining a trainer's group at a port where nobody listens) never holds up other requests; a
worker's weight method called by name through ``/collective_rpc`` cannot swap the weights behind the drain,
the prefix-cache reset and the version bump that ``/update_weights`` does; a level-2 sleep, a reload and a
wake serve again; a path the server cannot read is a 400 that says the same whether or not it exists.

The real server on the tiny Llama (float32, CPU, prefix caching on), over HTTP.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time

import pytest
import requests
from safetensors.torch import load_file, save_file

from stage5_server.server import create_app
from tests.stage5.server_fixtures import auth, make_llm, running_server

KEY = "dev-route-key"
PROMPT = "A weight update drains the engine, resets the prefix cache and counts a new version. " * 2


@pytest.fixture(scope="module")
def served(tiny_llama):
    app = create_app(make_llm(tiny_llama, device="cpu", dtype="float32", enable_prefix_caching=True,
                              enable_weight_sync=True),
                     api_keys=[KEY], enable_dev_routes=True)
    with pytest.MonkeyPatch.context() as env, running_server(app) as server:
        env.setenv("STAGEDSERVE_WEIGHT_SYNC_SECRET", secrets.token_hex(32))  # the engine's workers read it
        yield server.url


@pytest.fixture(scope="module")
def nudged_checkpoint(tiny_llama, tmp_path_factory):
    """The tiny Llama with other weights: every tensor scaled, so its greedy tokens differ."""
    import shutil

    path = shutil.copytree(tiny_llama, tmp_path_factory.mktemp("nudged") / "model")
    for file in path.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({name: (t * 1.5 if "norm" not in name else t).contiguous() for name, t in tensors.items()}, file,
                  metadata={"format": "pt"})
    return path


def post(url: str, route: str, body: dict | None = None, timeout: float = 120) -> requests.Response:
    return requests.post(f"{url}{route}", json=body, headers=auth(KEY), timeout=timeout)


def completion(url: str, timeout: float = 120) -> dict:
    response = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                             "ignore_eos": True}, timeout=timeout)
    assert response.status_code == 200, response.text
    return response.json()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nobody listens there


def test_joining_a_group_at_a_port_nobody_listens_on_never_holds_up_other_requests(served):
    answers = {}

    def join() -> None:
        answers["rpc"] = post(served, "/collective_rpc", {"method": "init_weight_update_group",
                                                          "args": ["127.0.0.1", closed_port(), 1, 2, 5]}, timeout=300)

    rpc = threading.Thread(target=join, daemon=True)
    rpc.start()
    time.sleep(0.5)  # the RPC has reached the engine
    started = time.monotonic()
    completion(served, timeout=30)  # a bystander
    assert time.monotonic() - started < 15
    rpc.join(30)
    assert not rpc.is_alive() and answers["rpc"].status_code == 200, answers
    tensors = [{"name": "model.norm.weight", "dtype": "float32", "shape": [128]}]
    failed = post(served, "/update_weights", {"tensors": tensors}, timeout=300)  # once the join gave up (5 s)
    assert failed.status_code == 400 and "did not form" in failed.json()["error"]["message"], failed.text
    completion(served, timeout=30)  # the engine serves on, on its old weights


@pytest.mark.parametrize("method, args", [
    ("update_weights_from_path", "{path}"),
    ("update_weights_from_distributed", [["model.norm.weight", "float32", [128]]]),
    ("update_weights", [[]]),
    ("remove_lora", 1),
    ("shutdown", None),
])
def test_a_weight_method_by_name_through_collective_rpc_is_refused_and_changes_nothing(served, nudged_checkpoint,
                                                                                      method, args):
    before = completion(served)
    args = [] if args is None else [str(nudged_checkpoint) if args == "{path}" else args]
    refused = post(served, "/collective_rpc", {"method": method, "args": args})
    assert refused.status_code == 400, refused.text
    assert method in refused.json()["error"]["message"]
    after = completion(served)
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert after["system_fingerprint"] == before["system_fingerprint"]


def test_the_update_route_drains_resets_the_cache_and_counts_a_version(served, nudged_checkpoint):
    completion(served)
    before = completion(served)
    assert before["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert post(served, "/update_weights", {"path": str(nudged_checkpoint)}).status_code == 200
    after = completion(served)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert after["system_fingerprint"] != before["system_fingerprint"]
    assert post(served, "/update_weights", {"reload": True}).status_code == 200  # the served weights again
    assert completion(served)["choices"][0]["text"] == before["choices"][0]["text"]


def test_a_level_2_sleep_then_a_reload_then_a_wake_serves_the_same_text(served):
    before = completion(served)["choices"][0]["text"]
    assert post(served, "/sleep?level=2").status_code == 200
    assert post(served, "/update_weights", {"reload": True}).status_code == 200
    assert post(served, "/wake_up").status_code == 200
    assert completion(served)["choices"][0]["text"] == before
    assert post(served, "/sleep?level=2").status_code == 200  # and the other order: wake, then reload
    assert post(served, "/wake_up").status_code == 200
    assert post(served, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 503
    assert post(served, "/update_weights", {"reload": True}).status_code == 200
    assert completion(served)["choices"][0]["text"] == before


def test_a_path_the_server_cannot_read_is_a_400_that_says_the_same_whether_it_exists(served, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("not a checkpoint")
    paths = ["/proc/1/root", "/proc/1/cwd", "x" * 5000, "/no/such/directory", str(tmp_path / "empty"),
             str(tmp_path / "a-file"), "", "\u0000"]
    messages = set()
    for path in paths:
        response = post(served, "/update_weights", {"path": path})
        assert response.status_code == 400, (path[:40], response.text)
        error = response.json()["error"]
        assert error["param"] == "path", error
        messages.add(error["message"])
    assert len(messages) == 1, messages  # nothing tells an existing directory from a missing one
    completion(served)

