"""The filesystem handed to Ray Train: built where it is used, not where it is unpickled."""

from __future__ import annotations

import pickle

import pyarrow.fs as pafs

from trainer_core import storage
from trainer_core.storage.lazyfs import LazyHandler, for_ray


def test_it_pickles_as_its_uri_and_builds_the_filesystem_at_first_use():
    uri = "memory://lazyfs-test/run"
    lazy = pafs.PyFileSystem(LazyHandler(uri))
    with lazy.open_output_stream("/lazyfs-test/run/a.txt") as f:
        f.write(b"written before pickling")
    copy = pickle.loads(pickle.dumps(lazy))
    handler = copy.handler
    assert isinstance(handler, LazyHandler) and handler._filesystem is None  # nothing built yet
    with copy.open_input_stream("/lazyfs-test/run/a.txt") as f:
        assert f.read() == b"written before pickling"
    assert handler._filesystem is not None
    copy.move("/lazyfs-test/run/a.txt", "/lazyfs-test/run/b.txt")
    infos = copy.get_file_info(pafs.FileSelector("/lazyfs-test/run"))
    assert [i.base_name for i in infos] == ["b.txt"]
    copy.delete_dir_contents("/lazyfs-test/run")
    assert copy.get_file_info("/lazyfs-test/run/b.txt").type == pafs.FileType.NotFound
    assert copy.type_name == "py::relaytrain-lazy"


def test_local_and_s3_pass_through_and_other_stores_are_wrapped(tmp_path):
    local = storage.resolve(str(tmp_path))
    assert for_ray(str(tmp_path), local.filesystem) is local.filesystem
    s3 = pafs.S3FileSystem(region="us-east-1")
    assert for_ray("s3://bucket/runs?region=us-east-1", s3) is s3
    uri = "memory://somewhere/runs"
    wrapped = for_ray(uri, storage.resolve(uri).filesystem)
    assert isinstance(wrapped.handler, LazyHandler) and wrapped.handler.uri == uri
