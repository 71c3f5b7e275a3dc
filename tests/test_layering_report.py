"""The layering report (scripts/layering_report.py) measures what its docstring says it measures.

Its numbers change as the code does, so these tests pin the mechanisms, not today's values: line counts
add up, imports are followed (and TYPE_CHECKING ones skipped where they must be) on small packages
written for the test, false friends do not count as feature words, and the request trace sees both
sides of a real server (slow: it starts two).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import layering_report as lr  # noqa: E402


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


@pytest.fixture(scope="module")
def report() -> lr.Report:
    return lr.static_report()


def test_shared_lines_are_the_sum_of_its_files_non_blank_lines(report):
    by_file = report.data["shared_lines_by_file"]
    assert by_file and all(name.startswith("shared/") for name in by_file)
    assert report.data["shared_lines"] == sum(by_file.values())
    blank_free = sum(1 for path in lr.py_files(lr.REPO / "shared")
                     for line in path.read_text().splitlines() if line.strip())
    assert report.data["shared_lines"] == blank_free


def test_stage1_reach_holds_stage1_and_the_shared_package_and_no_later_stage(report):
    own = {m for m in lr.ModuleIndex().path_of if m.split(".")[0] == "stage1_naive"}
    index = lr.ModuleIndex()
    for key in ("stage1_static", "stage1_at_import"):
        reach = set(report.data[key]["module_names"])
        lazy = {"stage1_naive.llm"} if key == "stage1_at_import" else set()  # the front end: on first use
        assert (own - lazy) | {"shared"} <= reach and not lazy & reach
        assert all(m.split(".")[0] in ("shared", "stage1_naive") for m in reach)  # no stage imports a later one
        assert report.data[key]["modules"] == len(reach)
        assert report.data[key]["lines"] == index.lines(reach)


def test_every_row_is_in_the_table_and_every_feature_room_exists(report):
    labels = [label for label, _ in report.rows]
    assert len(labels) == 8 + len(lr.FEATURES)  # rows 1, 2a, 2b, 4, 5 (one per feature), 6, 7 (three rows)
    for feature in lr.FEATURES:
        rooms = lr.feature_rooms(feature)
        assert rooms and all(room.exists() for room in rooms), feature.name  # a renamed room is noticed here


def test_static_reach_follows_every_import_statement_and_runs_parent_packages(tmp_path):
    root = write_tree(tmp_path, {
        "shared/__init__.py": "",
        "shared/unused.py": "x = 1\n",
        "shared/deep/__init__.py": "",
        "shared/deep/mod.py": "def g():\n    return 1\n",
        "shared/typed.py": "",
        "stage1_x/__init__.py": "from stage1_x.a import f\n",
        "stage1_x/a.py": """\
            from typing import TYPE_CHECKING
            from . import b

            if TYPE_CHECKING:
                import shared.typed


            def f():
                from shared.deep.mod import g  # inside a function: followed statically, not run at import
                return g()
            """,
        "stage1_x/b.py": "",
    })
    index = lr.ModuleIndex(root)
    own = [m for m in index.path_of if m.startswith("stage1_x")]
    assert lr.static_reach(index, own) == {"stage1_x", "stage1_x.a", "stage1_x.b", "shared", "shared.deep",
                                           "shared.deep.mod", "shared.typed"}
    assert lr.import_time_reach(index, "stage1_x") == {"stage1_x", "stage1_x.a", "stage1_x.b"}


def test_cycle_finder_sees_a_cycle_between_rooms_but_not_one_under_type_checking(tmp_path):
    root = write_tree(tmp_path, {
        "stage9_rooms/__init__.py": "",
        "stage9_rooms/a/__init__.py": "from . import inner  # a package re-exporting its own module: no edge\n"
                                      "from stage9_rooms.b import x\n",
        "stage9_rooms/a/inner.py": "from stage9_rooms import c\n",
        "stage9_rooms/b/__init__.py": "x = 1\n\n\ndef f():\n    from stage9_rooms.a import inner\n",
        "stage9_rooms/c.py": "from typing import TYPE_CHECKING\n\n"
                             "if TYPE_CHECKING:\n    from stage9_rooms.a import inner\n",
    })
    graph = lr.room_graph(lr.ModuleIndex(root), top="stage9_rooms")
    assert {room: set(targets) for room, targets in graph.items()} == {
        "__init__": set(), "a": {"b", "c"}, "b": {"a"}, "c": set()}
    assert lr.simple_cycles(graph) == [["a", "b"]]

    (root / "stage9_rooms/c.py").write_text("from stage9_rooms.a import inner\n")  # now a real import
    assert sorted(lr.simple_cycles(lr.room_graph(lr.ModuleIndex(root), top="stage9_rooms"))) == [
        ["a", "b"], ["a", "c"]]


def test_type_hints_alone_make_their_own_edges_and_can_close_a_two_way_pair(tmp_path):
    root = write_tree(tmp_path, {
        "stage9_rooms/__init__.py": "",
        "stage9_rooms/core/__init__.py": "from stage9_rooms.executor import run\n",
        "stage9_rooms/executor/__init__.py": "from typing import TYPE_CHECKING\n\n"
                                             "if TYPE_CHECKING:\n    from stage9_rooms.core import Output\n",
    })
    index = lr.ModuleIndex(root)
    assert {a: set(b) for a, b in lr.room_graph(index, "stage9_rooms").items()} == {
        "__init__": set(), "core": {"executor"}, "executor": set()}
    assert {a: set(b) for a, b in lr.room_graph(index, "stage9_rooms", type_checking=True).items()} == {
        "__init__": set(), "core": set(), "executor": {"core"}}
    full = lr.room_graph(index, "stage9_rooms", type_checking=None)
    assert lr.simple_cycles(full) == [["core", "executor"]]


def test_a_requests_modules_split_by_layer_and_feature_rooms_are_found_by_path():
    modules = ["shared.model", "stage3_continuous.scheduler", "stage5_server.core.engine_core",
               "stage5_server.lora.request", "stage5_server.weight_sync.core", "stage5_server.server.chat"]
    assert lr.by_layer(modules) == {"stage5": modules[2:3] + ["stage5_server.lora.request", "stage5_server.server.chat",
                                                              "stage5_server.weight_sync.core"],
                                    "lower": ["stage3_continuous.scheduler"], "shared": ["shared.model"]}
    assert lr.in_feature_rooms(modules) == ["stage5_server.lora.request", "stage5_server.weight_sync.core"]


def test_simple_cycles_counts_each_elementary_cycle_once():
    graph = {"a": ["b"], "b": ["c", "a"], "c": ["a"], "d": ["d"]}
    assert sorted(lr.simple_cycles(graph)) == [["a", "b"], ["a", "b", "c"], ["d"]]


def feature(name: str) -> lr.Feature:
    return next(f for f in lr.FEATURES if f.name == name)


def test_feature_words_count_real_uses_and_ignore_the_documented_false_friends(tmp_path):
    root = write_tree(tmp_path, {
        "shared/__init__.py": "",
        "shared/words.py": """\
            self.block_pool = BlockPool(10)  # stage 4's KV blocks
            pool = ThreadPoolExecutor(4)
            free = self.kv_cache_manager.block_pool.free_block_queue
            hidden = self.embed_tokens(input_ids)
            max_position_embeddings: int = 2048
            self.rotary_emb = RotaryEmbedding(64)
            encoder = msgspec.msgpack.Encoder()
            sock.send(encoder.encode(message))
            checker = TypeAdapter(int)
            name = "Albert"

            pooled: list[float] | None = None
            EMBEDDING_MODEL_NAME = "all-minilm-l6-v2"
            if config.is_encoder:
            enable_lora: bool = False
            class MaxLoRASlots:
            num_draft_tokens: int = 0
            """,
        "stage5_server/__init__.py": "",
        "stage5_server/pooling/__init__.py": "pooled = pooler(pooling)\n",  # the room itself: not counted
        "stage5_server/bench/__init__.py": "pooled = 1\n",  # bench/: not counted
        "stage5_server/server/pooling.py": "async def embed(self, request):\n",
    })
    pooling = lr.feature_lines_outside(feature("pooling"), root)
    assert {f: [n for n, _ in lines] for f, lines in pooling.items()} == {
        "shared/words.py": [12, 13, 14], "stage5_server/server/pooling.py": [1]}
    lora = lr.feature_lines_outside(feature("LoRA"), root)
    assert [n for n, _ in lora["shared/words.py"]] == [15, 16]
    spec = lr.feature_lines_outside(feature("speculative decoding"), root)
    assert [n for n, _ in spec["shared/words.py"]] == [17]
    # Row 6: the design's expression, block_pool blanked; its \b boundaries miss enable_lora and num_draft_tokens.
    words = lr.stage5_words_before_stage5(root)
    assert [n for n, _ in words["shared/words.py"]] == [12]
    assert "stage5_server/server/pooling.py" not in words


def test_word_regex_starts_at_a_word_or_a_camel_case_hump():
    regex = lr.word_regex(["bert", "lora", "vision"])
    hits = [text for text in ("BertModel", "bert", "enable_lora", "MaxLoRA", "lora_request", "VISION_CONFIG",
                              "Albert", "ALBERT", "division", "revision", "exploration") if regex.search(text)]
    assert hits == ["BertModel", "bert", "enable_lora", "MaxLoRA", "lora_request", "VISION_CONFIG"]


def test_static_only_run_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "layering.json"
    assert lr.main(["--static-only", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert printed.startswith("| measure")
    assert data["rows"] and all(label in printed for label in data["rows"])
    assert data["numbers"]["shared_lines"] == data["shared_lines"]
    assert data["numbers"]["room_import_cycles"] == data["room_import_cycles"]["cycles"]
    for name, numbers in data["features_outside_room"].items():
        assert numbers["lines"] == sum(numbers["by_file"].values()) == sum(map(len, numbers["matches"].values())), name
    assert data["room_import_cycles"]["cycles"] == len(data["room_import_cycles"]["list"])
    assert data["numbers"]["room_two_way_pairs"] == len(data["room_two_way_pairs"])
    assert data["numbers"]["room_type_only_edges"] == len(data["room_type_only_edges"])


@pytest.mark.slow
def test_request_trace_sees_the_api_and_the_engine_core_in_both_modes():
    thread = lr.measure_request("thread")
    proc = lr.measure_request("engine-process")
    for result in (thread, proc):
        assert result["measured"]["chunks"] > 0 and result["window_s"] > lr.SETTLE_S
    api = set(proc["api"]["called"])
    engine = {m for e in proc["engines"] for m in e["called"]}
    assert len(proc["engines"]) == 1 and not proc["engines"][0]["untraced_threads"]
    # The forward pass runs where the engine core runs; the HTTP side only in the API process.
    assert "shared.model" in thread["api"]["called"] and "shared.model" in engine and "shared.model" not in api
    assert any(m.startswith("stage5_server.server.") for m in api)
    assert not any(m.startswith("stage5_server.server.") for m in engine)
    assert lr.in_feature_rooms(set(thread["api"]["called"]) | api | engine) == []  # a server without features
    everything = api | engine | set(thread["api"]["called"])
    assert all(m.split(".")[0] == "shared" or m.startswith("stage") for m in everything)
