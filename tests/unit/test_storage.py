import pyarrow.fs as pafs
import pytest

from trainer_core import storage
from trainer_core.errors import (
    SpecError,
    StorageAccessError,
    StorageError,
    StorageFullError,
    StorageUnavailableError,
)


def test_local_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    location = storage.resolve("./runs")
    assert location.path == str(tmp_path / "runs")
    assert location.is_local
    assert storage.resolve(f"file://{tmp_path}/x").path == str(tmp_path / "x")


def test_write_read_list_delete_local(tmp_path):
    root = storage.resolve(str(tmp_path))
    target = root.child("a", "b.json")
    target.write_json({"schema": 1, "x": 1})
    assert target.read_json()["x"] == 1
    assert [i.base_name for i in root.child("a").list()] == ["b.json"]  # no temp file left
    root.child("a").delete_dir()
    assert not root.child("a").exists()
    storage.probe_writable(root.child("new", "deep"))


def test_memory_filesystem_through_fsspec():
    root = storage.resolve("memory://bucket/runs")
    assert isinstance(root.filesystem, pafs.PyFileSystem)
    root.child("x.bin").write_bytes(b"abc")
    assert root.child("x.bin").read_bytes() == b"abc"
    assert root.child("x.bin").uri == "memory:///bucket/runs/x.bin"
    storage.probe_writable(root)


def test_remote_uris_keep_double_slashes():
    location = storage.resolve("s3://bucket/prefix?endpoint_override=127.0.0.1:1&scheme=http")
    assert isinstance(location.filesystem, pafs.S3FileSystem)
    assert location.path == "bucket/prefix"
    assert location.child("run", "x").uri == "s3://bucket/prefix/run/x"


def test_fsspec_forced_protocol():
    location = storage.resolve("fsspec+memory://forced/place")
    assert isinstance(location.filesystem, pafs.PyFileSystem)


def test_credentials_in_uri_are_refused():
    with pytest.raises(SpecError, match="AWS_ACCESS_KEY_ID"):
        storage.resolve("s3://bucket/p?access_key=AKIA&secret_key=shh")


def test_unknown_protocol_is_a_spec_error():
    with pytest.raises(SpecError, match="not available"):
        storage.resolve("nosuchproto://x/y")


def test_child_refuses_escapes(tmp_path):
    root = storage.resolve(str(tmp_path))
    for bad in ("..", "", "/etc"):
        with pytest.raises(ValueError):
            root.child(bad)


def test_probe_reports_unwritable_location(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError, match="not writable"):
        storage.probe_writable(storage.resolve(str(blocker / "runs")))


@pytest.mark.parametrize(
    "error, expected",
    [
        (PermissionError(13, "Permission denied"), StorageAccessError),
        (OSError(28, "No space left on device"), StorageFullError),
        (OSError(30, "Read-only file system"), StorageAccessError),
        (OSError("AWS Error ACCESS_DENIED during HeadBucket operation"), StorageAccessError),
        (OSError("AWS Error INVALID_ACCESS_KEY_ID during ListObjectsV2"), StorageAccessError),
        (OSError("AWS Error NO_SUCH_BUCKET during HeadBucket operation"), StorageAccessError),
        (OSError("AWS Error NETWORK_CONNECTION during PutObject"), StorageUnavailableError),
        (ValueError("not a storage failure"), type(None)),
    ],
)
def test_storage_failures_are_classified_by_what_fixes_them(error, expected):
    classified = storage.storage_error("s3://bucket/run", "write", error)
    assert type(classified) is expected
    if classified is not None and expected is not StorageUnavailableError:
        assert classified.budget == "none" and "run." in str(classified)
    if classified is not None:
        assert "s3://bucket/run" in str(classified)


def test_transport_errors_of_s3fs_are_transient():
    from botocore.exceptions import EndpointConnectionError

    error = EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
    assert isinstance(storage.storage_error("s3://b/r", "list", error), StorageUnavailableError)
