"""Bounded JSON: depth, size and numbers are refused with one line before the parser builds anything."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from edm2.runtime import bounded_json
from edm2.runtime.bounded_json import JSONFileError

pytestmark = pytest.mark.bad_input


def test_ordinary_json_reads_back():
    text = '{"a": [1, 2.5, {"b": "x[y{z"}], "c": -3, "d": null, "e": true}'
    assert bounded_json.parse(text, "f.json") == {"a": [1, 2.5, {"b": "x[y{z"}], "c": -3, "d": None, "e": True}


def test_brackets_inside_strings_do_not_count_as_nesting():
    assert bounded_json.nesting_depth(b'["[[[[", "\\"[[[", {"k": "{{{"}]') == 2


@pytest.mark.parametrize("text, words", [
    ("[" * 100_000 + "]" * 100_000, "nested 100000 levels"),
    ('{"a":' * 40 + "1" + "}" * 40, "nested 40 levels"),
    ("1" + "0" * 400, "more than 20 digits"),
    ("-" + "9" * 5000, "more than 20 digits"),
    ("1e400", "not finite"),
    ("[NaN]", "NaN is not a JSON number"),
    ("[-Infinity]", "Infinity is not a JSON number"),
    ('{"a": ', "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
])
def test_hostile_json_is_one_line_naming_the_source(text, words):
    with pytest.raises(JSONFileError) as info:
        bounded_json.parse(text, "run/stats.jsonl")
    message = str(info.value)
    assert "\n" not in message and message.startswith("run/stats.jsonl: ") and words in message


def test_a_file_larger_than_its_bound_is_refused_without_reading_it_whole(tmp_path):
    path = tmp_path / "big.json"
    path.write_text("[" + "0," * 1000 + "0]")
    with pytest.raises(JSONFileError, match="more than the 100 this file may hold"):
        bounded_json.read(path, max_bytes=100)


def test_deep_nesting_is_refused_within_a_memory_bound(tmp_path):
    # 10 million nested lists: the refusal must come from the linear scan, within 1 GiB of address space.
    path = tmp_path / "deep.json"
    path.write_bytes(b"[" * 10_000_000 + b"]" * 10_000_000)
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30));"
            "from edm2.runtime import bounded_json\n"
            "try:\n bounded_json.read(sys.argv[1])\nexcept bounded_json.JSONFileError as e:\n print(e)")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "nested 10000000 levels" in done.stdout


def test_read_object_is_an_object_none_or_one_error_of_the_callers_class(tmp_path):
    class CallersError(JSONFileError):
        pass

    (tmp_path / "object.json").write_text('{"a": [1]}')
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "folder.json").mkdir()
    assert bounded_json.read_object(tmp_path / "object.json") == {"a": [1]}
    assert bounded_json.read_object(tmp_path / "missing.json") is None
    with pytest.raises(CallersError, match=f"^{re.escape(str(tmp_path / 'list.json'))}: a JSON list, not an object$"):
        bounded_json.read_object(tmp_path / "list.json", CallersError)
    with pytest.raises(CallersError, match=f"^{re.escape(str(tmp_path / 'folder.json'))}: cannot read"):
        bounded_json.read_object(tmp_path / "folder.json", CallersError)


def test_every_json_the_project_reads_goes_through_the_bounded_reader():
    """A plain json.load or json.loads of read data would bring back the RecursionError and the unbounded numbers;
    only a round trip of our own objects (json.loads(json.dumps(...))) may use the json module's parser."""
    repo = Path(__file__).resolve().parents[1]
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.py"],
                            cwd=repo, capture_output=True, text=True, check=True).stdout.split()
    plain = re.compile(r"\bjson\.loads?\((?!json\.dumps\()")
    found = [f"{name}:{number}" for name in listed if not name.startswith("tests/")
             and name != "edm2/runtime/bounded_json.py"
             for number, line in enumerate((repo / name).read_text().splitlines(), 1) if plain.search(line)]
    assert found == []
