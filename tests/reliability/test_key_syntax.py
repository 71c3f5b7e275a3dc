"""An API key is the whole string the operator gave, whatever it holds: ``sk:LongSecret`` is one key,
``sk`` alone opens nothing, and neither the key nor any part of it reaches the log. A trust group is
given as ``'KEY group=NAME'``, a form no key can take (a key holds no whitespace)."""

from __future__ import annotations

import httpx
import pytest

from stage5_server.cli import main
from stage5_server.cli.options import resolve_api_keys
from tests.stage5.server_fixtures import auth, running_server

SECRET = "sk:LongSecretPart"


def test_a_key_with_a_colon_is_one_key_and_a_group_needs_its_own_word():
    assert resolve_api_keys([SECRET], None) == {SECRET: None}
    assert resolve_api_keys(["a:b:c", "k1 group=ops"], None) == {"a:b:c": None, "k1": "ops"}
    assert resolve_api_keys(None, "x group=g1, y group=g1 ,z:w") == {"x": "g1", "y": "g1", "z:w": None}
    for bad in (["a", "a"], ["k ops"], ["k group="], ["k group=a extra"], ["Bearer sk-1"]):
        with pytest.raises(ValueError, match="api_key") as error:
            resolve_api_keys(bad, None)
        assert "sk-1" not in str(error.value) and "ops" not in str(error.value)


def test_serve_accepts_only_the_whole_key_and_never_logs_it(tiny_llama, monkeypatch, caplog):
    import uvicorn

    answers = {}

    def run(app, **kwargs):  # the app as ``serve`` built it, over real HTTP
        with running_server(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
            for key in (SECRET, "sk", "LongSecretPart"):
                answers[key] = client.get("/v1/models", headers=auth(key)).status_code
            answers["groups"] = app.state.api_keys.groups

    monkeypatch.setattr(uvicorn, "run", run)
    monkeypatch.delenv("STAGEDSERVE_API_KEY", raising=False)
    with caplog.at_level("DEBUG", logger="stagedserve"):
        assert main(["serve", str(tiny_llama), "--port", "0", "--max-model-len", "128", "--num-kv-blocks", "16",
                     "--api-key", SECRET, "--api-key", "other group=ops", "--log-stats-interval", "0",
                     "--no-engine-process"]) == 0
    assert answers == {SECRET: 200, "sk": 401, "LongSecretPart": 401, "groups": ["key#1", "ops"]}
    assert "LongSecret" not in caplog.text and "sk:" not in caplog.text
    assert "contains ':'" in caplog.text  # the operator is told how a group is given now
