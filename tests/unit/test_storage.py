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


#: What each backend a URI can reach takes a credential as (their signatures and docs):
#: pyarrow's S3FileSystem and GcsFileSystem, s3fs, gcsfs, adlfs (Azure), Databricks/HTTP tokens.
BACKEND_CREDENTIALS = {
    "pyarrow s3": ["access_key", "secret_key", "session_token"],
    "pyarrow gcs": ["access_token"],
    "s3fs": ["key", "secret", "token", "password"],
    "botocore": ["aws_access_key_id", "aws_secret_access_key", "aws_session_token"],
    "gcsfs": ["token"],
    "adlfs": ["account_key", "sas_token", "connection_string", "client_secret", "credential"],
    "azure, as its SDK spells them": ["AccountKey", "SharedAccessSignature", "sasToken", "sig"],
}


@pytest.mark.parametrize(
    "name", [n for names in BACKEND_CREDENTIALS.values() for n in names], ids=str
)
@pytest.mark.parametrize(
    "base", ["s3://bucket/runs", "gs://bucket/runs", "fsspec+memory://bucket/runs"]
)
def test_a_credential_in_a_uri_is_refused_by_its_shape_for_every_backend(base, name, tmp_path):
    """Refused at setup, naming the option (never its value), before anything is reached."""
    from tasks.setup import refuse_bad_input
    from tests.conftest import tiny_raw
    from trainer_core.spec.overrides import build_spec

    uri = f"{base}?endpoint_override=127.0.0.1:1&{name}=CANARY-{name}"
    with pytest.raises(SpecError) as raised:
        storage.resolve(uri)
    assert f"{name}=..." in str(raised.value) and "CANARY" not in str(raised.value)
    with pytest.raises(SpecError) as raised:
        refuse_bad_input(build_spec(tiny_raw(uri, "leaky")))
    assert raised.value.field == "run.storage" and "CANARY" not in str(raised.value)


def test_options_that_name_no_secret_pass():
    for name in ("endpoint_override", "region", "scheme", "sse_kms_key_id", "project_id"):
        assert not storage.uris.is_credential_option(name), name


@pytest.mark.parametrize(
    "uri",
    [
        "http://user:hunter2@mlflow.internal:5000",
        "https://mlflow.internal/?token=CANARY",
        "https://mlflow.internal/?access_token=CANARY",
    ],
)
def test_a_tracking_uri_from_the_environment_with_a_credential_is_refused_at_setup(
    uri, tmp_path, monkeypatch
):
    """MLFLOW_TRACKING_URI was never checked: its password reached mlflow.json, the result and
    Prefect's artifacts. Refused before anything is written, naming the variable."""
    from tasks.setup import refuse_bad_input
    from tests.conftest import tiny_raw
    from trainer_core.spec.overrides import build_spec

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    spec = build_spec(tiny_raw(tmp_path / "runs", "tracked"))
    with pytest.raises(SpecError) as raised:
        refuse_bad_input(spec)
    assert raised.value.field == "MLFLOW_TRACKING_URI"
    assert "hunter2" not in str(raised.value) and "CANARY" not in str(raised.value)
    assert not (tmp_path / "runs").exists()
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    with pytest.raises(SpecError, match=r"tracking\.mlflow_uri") as raised:  # in the spec too
        in_spec = {**tiny_raw(tmp_path / "runs", "tracked"), "tracking": {"mlflow_uri": uri}}
        refuse_bad_input(build_spec(in_spec))
    assert "hunter2" not in str(raised.value) and "CANARY" not in str(raised.value)
    assert not (tmp_path / "runs").exists()


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
