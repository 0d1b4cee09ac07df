"""What a failed storage call means for the run: refused credentials, a missing bucket, a full or
read-only store, a path that can never hold it (none retried), or a passing outage (retried)."""

from __future__ import annotations

import errno

from trainer_core.errors import (
    StorageAccessError,
    StorageError,
    StorageFullError,
    StorageUnavailableError,
)

#: What access refusals look like in pyarrow's (AWS SDK) and s3fs's (botocore) messages.
ACCESS_SIGNS = (
    "ACCESS_DENIED",
    "AccessDenied",
    "INVALID_ACCESS_KEY_ID",
    "InvalidAccessKeyId",
    "SIGNATURE_DOES_NOT_MATCH",
    "SignatureDoesNotMatch",
    "EXPIRED_TOKEN",
    "ExpiredToken",
    "InvalidToken",
    "HTTP status 401",
    "HTTP status 403",
    "Forbidden",
    "Unauthorized",
    "Unable to locate credentials",
    "NoCredentialsError",
    "AllAccessDisabled",
)


MISSING_BUCKET_SIGNS = ("NO_SUCH_BUCKET", "NoSuchBucket", "specified bucket does not exist")


#: pyarrow's GCS client creates a missing bucket; with no project to create it in, it says so.
GCS_CREATE_BUCKET_SIGNS = ("CreateBucket", "missing project id")


FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


#: A path that can never hold the run (a file where a directory should be, a name too long).
BAD_PATH_ERRNOS = (errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP)


#: A full disk, and full object stores in pyarrow's and s3fs's messages: MinIO past its drives'
#: free-space threshold (HTTP 507 XMinioStorageFull), Ceph's RGW past a quota (403
#: QuotaExceeded, which must not read as refused credentials).
FULL_SIGNS = (
    "No space left on device",
    "Disk quota exceeded",
    "XMinioStorageFull",
    "HTTP status 507",
    "QuotaExceeded",
)


#: Packages whose own exception types mean "the connection failed" (not OSError subclasses).
TRANSPORT_PACKAGES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests")


def storage_error(uri: str, verb: str, error: BaseException) -> StorageError | None:
    """What a filesystem failure means for the run (None: not a storage failure).

    Refused credentials or permissions, a read-only store and a missing bucket are not retried
    (a retry cannot fix them); a full disk neither; anything else, such as a connection that
    failed, is a transient StorageUnavailableError.
    """
    text = f"{type(error).__name__}: {error}"
    if all(sign in text for sign in GCS_CREATE_BUCKET_SIGNS):
        return StorageAccessError(
            f"could not {verb} {uri}: its bucket does not exist (pyarrow's GCS client tried to "
            f"create it: {error}). Create the bucket, or fix run.storage.",
            field="run.storage",
        )
    transport = type(error).__module__.split(".")[0] in TRANSPORT_PACKAGES
    if not isinstance(error, OSError) and not transport:
        return None
    code = getattr(error, "errno", None)
    if code in FULL_ERRNOS or any(sign in text for sign in FULL_SIGNS):
        return StorageFullError(
            f"storage is full: could not {verb} {uri} ({error}). Free space (or raise the quota) "
            "there and run again to resume, or choose another run.storage.",
            field="run.storage",
        )
    if code in BAD_PATH_ERRNOS:
        return StorageAccessError(
            f"could not {verb} {uri}: {error}. Fix run.storage: it must name a directory (or a "
            "place one can be created).",
            field="run.storage",
        )
    if code == errno.EROFS:
        return StorageAccessError(
            f"storage is read-only: could not {verb} {uri} ({error}). Choose a writable "
            "run.storage.",
            field="run.storage",
        )
    if any(sign in text for sign in MISSING_BUCKET_SIGNS):
        return StorageAccessError(
            f"could not {verb} {uri}: its bucket does not exist ({error}). Create the bucket, or "
            "fix run.storage.",
            field="run.storage",
        )
    if isinstance(error, PermissionError) or any(sign in text for sign in ACCESS_SIGNS):
        return StorageAccessError(
            f"access denied to {verb} {uri} ({error}). Fix the credentials (AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY or the provider's variables in the environment, or the Prefect "
            "block named by run.credentials), grant them read and write access to that location, "
            "or choose another run.storage.",
            field="run.credentials",
        )
    return StorageUnavailableError(f"could not {verb} {uri}: {error}")
