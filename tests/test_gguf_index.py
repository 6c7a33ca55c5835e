"""The index of a GGUF file's tensors kept beside its converted folder (gguf_index): what it gives equals
what GGUFReader gives, it is written at conversion and on first need, and a stale or broken one is
not trusted."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGUFReader

from pagecli.errors import ModelError
from pagecli.models import gguf_index
from pagecli.models.gguf_index import INDEX_FILE, read_tensors
from pagecli.models.source import default_model_gguf


@pytest.fixture(scope="module")
def reader():
    """The embedded file's tensors as GGUFReader gives them (parsed once: about 4 s)."""
    return {t.name: t for t in GGUFReader(default_model_gguf()).tensors}


def assert_same_as_the_reader(tensors, reader):
    assert set(tensors) == set(reader)
    for name, tensor in tensors.items():
        expected = reader[name]
        assert tensor.tensor_type == expected.tensor_type, name
        assert tensor.shape == tuple(int(d) for d in expected.shape), name
        assert np.array_equal(tensor.data, np.asarray(expected.data).reshape(-1).view(np.uint8)), name


def test_the_converted_embedded_model_carries_an_index_equal_to_the_reader(smollm2_dir, reader):
    assert (smollm2_dir / INDEX_FILE).is_file()  # written by the conversion
    assert_same_as_the_reader(read_tensors(default_model_gguf(), smollm2_dir), reader)


def test_a_folder_without_the_index_gets_it_on_first_need(tmp_path, monkeypatch):

    parsed = []
    real = gguf_index.open_reader
    monkeypatch.setattr(gguf_index, "open_reader", lambda path: parsed.append(path) or real(path))
    first = read_tensors(default_model_gguf(), tmp_path)
    assert len(parsed) == 1 and (tmp_path / INDEX_FILE).is_file()
    second = read_tensors(default_model_gguf(), tmp_path)
    assert len(parsed) == 1  # the index, not the file's metadata
    assert {n: (t.tensor_type, t.shape) for n, t in first.items()} == {n: (t.tensor_type, t.shape) for n, t in second.items()}


@pytest.fixture
def parses(monkeypatch, reader):
    """The files read_tensors parses with GGUFReader (the parse itself replaced by the module's one)."""

    opened = []
    monkeypatch.setattr(gguf_index, "open_reader",
                        lambda path: opened.append(path) or SimpleNamespace(tensors=list(reader.values())))
    return opened


@pytest.mark.parametrize("damage", ["other_size", "garbage", "wrong_entry", "old_version"])
def test_a_stale_or_broken_index_is_not_trusted(tmp_path, damage, reader, parses):
    gguf_index.write_index(gguf_index.index_entries(SimpleNamespace(tensors=list(reader.values()))),
                           default_model_gguf(), tmp_path)
    index_path = tmp_path / INDEX_FILE
    index = json.loads(index_path.read_text())
    if damage == "other_size":
        index["source_bytes"] += 1
    elif damage == "wrong_entry":
        index["tensors"]["output_norm.weight"] = ["F32"]
    elif damage == "old_version":
        index["version"] = 0
    index_path.write_text("{not json" if damage == "garbage" else json.dumps(index))
    assert_same_as_the_reader(read_tensors(default_model_gguf(), tmp_path), reader)
    assert parses == [default_model_gguf()]  # the file, not the index
    assert json.loads(index_path.read_text())["source_bytes"] == default_model_gguf().stat().st_size  # rewritten


def test_a_read_only_folder_still_reads_the_file(tmp_path, monkeypatch, parses):
    def refuse(*args, **kwargs):
        raise PermissionError("read-only")

    monkeypatch.setattr(gguf_index, "write_index", refuse)
    assert len(read_tensors(default_model_gguf(), tmp_path)) == 272  # the embedded file's tensors
    assert not (tmp_path / INDEX_FILE).exists() and len(parses) == 1


def test_a_truncated_file_is_a_clear_error(tmp_path, reader):
    copy = tmp_path / "model.gguf"
    shutil.copyfile(default_model_gguf(), copy)
    with open(copy, "r+b") as f:
        f.truncate(copy.stat().st_size - 1000)
    # the whole file's index, as if written before the file was cut
    gguf_index.write_index(gguf_index.index_entries(SimpleNamespace(tensors=list(reader.values()))), copy, tmp_path)
    with pytest.raises(ModelError, match="shorter than its tensor"):
        read_tensors(copy, tmp_path)


def test_the_type_names_read_without_gguf_are_ggmls_own():
    from gguf import GGMLQuantizationType

    from pagecli.models.gguf_files import _COMMON_TYPE_NAMES, type_name_of

    for kind, name in _COMMON_TYPE_NAMES.items():
        assert GGMLQuantizationType(kind).name == name
    assert type_name_of(int(GGMLQuantizationType.IQ4_NL)) == "IQ4_NL"  # a rarer one, through gguf


def test_the_type_counts_read_from_the_index_equal_the_readers(smollm2_dir, reader):
    from pagecli.models.gguf_files import tensor_types

    expected: dict[str, int] = {}
    for tensor in reader.values():
        if tensor.name.startswith("blk.") and len(tensor.shape) == 2:
            expected[tensor.tensor_type.name] = expected.get(tensor.tensor_type.name, 0) + 1
    assert tensor_types(default_model_gguf(), smollm2_dir) == expected == {"Q4_1": 210}
