"""A real S3-compatible server on loopback for tests: moto's server mode as a subprocess, with
IAM authentication enforced.

- ``moto_s3(log_dir)`` starts moto's server (``tests/moto_server.py``: its conditional writes
  atomic, as S3's) on 127.0.0.1 and a free port, waits until it answers, creates IAM users and
  a bucket through moto's own IAM API, and stops it on exit. moto lets the first
  ``INITIAL_NO_AUTH_ACTION_COUNT`` authenticated actions through unsigned
  (moto/core/authorization.py counts every IAM/S3 action it authorizes); three bootstrap calls
  create an admin user with its key, and from then on every request must carry a valid,
  permitted key. The trainer user's generated key pair is the tests' credential (and canary).
- ``tests.outage_proxy.OutageProxy`` goes in front of it to play an outage, slow storage or a
  full store.

No key in this file is real: moto generates them per server.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.net import free_port, stop, wait_until_answers

REGION = "us-east-1"
#: Bootstrap actions moto lets through unsigned: create the admin user, its policy, its key.
BOOTSTRAP_ACTIONS = 3
ALLOW_ALL = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
}


@dataclass
class S3Server:
    """A running moto server: where it listens, its bucket, and the users' key pairs."""

    port: int
    bucket: str
    access_key_id: str
    secret_access_key: str
    admin_key: tuple[str, str]
    trainer_user: str
    log_file: Path
    process: subprocess.Popen = field(repr=False)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def uri(self, prefix: str, *, port: int | None = None, fsspec: bool = False) -> str:
        """``s3://bucket/prefix`` through pyarrow (or s3fs when ``fsspec``), via ``port``."""
        scheme = "fsspec+s3" if fsspec else "s3"
        endpoint = f"127.0.0.1:{port or self.port}"
        return f"{scheme}://{self.bucket}/{prefix}?endpoint_override={endpoint}&scheme=http"

    def credential_env(self) -> dict[str, str]:
        """The trainer's credentials as the AWS SDKs read them from the environment."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_DEFAULT_REGION": REGION,
        }

    def admin(self, service: str) -> Any:
        """A boto3 client of ``service`` signed with the admin key (for the tests' own checks)."""
        import boto3

        return boto3.client(
            service,
            endpoint_url=f"http://{self.endpoint}",
            region_name=REGION,
            aws_access_key_id=self.admin_key[0],
            aws_secret_access_key=self.admin_key[1],
        )

    def objects(self, prefix: str) -> dict[str, bytes]:
        """Every object below ``prefix`` in the bucket, key -> bytes (read as admin)."""
        s3 = self.admin("s3")
        found: dict[str, bytes] = {}
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                body = s3.get_object(Bucket=self.bucket, Key=item["Key"])["Body"].read()
                found[item["Key"]] = body
        return found

    @contextlib.contextmanager
    def denied(self, actions: list[str], resource: str) -> Iterator[None]:
        """While inside, the trainer's key is explicitly denied ``actions`` on ``resource``."""
        iam = self.admin("iam")
        name = f"deny-{uuid.uuid4().hex[:8]}"
        document = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Deny", "Action": actions, "Resource": resource}],
        }
        iam.put_user_policy(
            UserName=self.trainer_user, PolicyName=name, PolicyDocument=json.dumps(document)
        )
        try:
            yield
        finally:
            iam.delete_user_policy(UserName=self.trainer_user, PolicyName=name)


def _bootstrap(port: int, bucket: str) -> dict[str, Any]:
    """Admin user (unsigned, within moto's no-auth allowance), then the trainer and the bucket."""
    import boto3
    from botocore.exceptions import ClientError

    endpoint = f"http://127.0.0.1:{port}"

    def client(service: str, key: str, secret: str) -> Any:
        return boto3.client(
            service,
            endpoint_url=endpoint,
            region_name=REGION,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
        )

    # Counted as moto's unauthenticated allowance: any signature passes for these three.
    iam = client("iam", "bootstrap", "bootstrap")
    iam.create_user(UserName="relaytrain-admin")
    iam.put_user_policy(
        UserName="relaytrain-admin", PolicyName="all", PolicyDocument=json.dumps(ALLOW_ALL)
    )
    admin_key = iam.create_access_key(UserName="relaytrain-admin")["AccessKey"]
    admin = (admin_key["AccessKeyId"], admin_key["SecretAccessKey"])
    iam = client("iam", *admin)
    iam.create_user(UserName="relaytrain-trainer")
    trainer_policy = {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Action": "s3:*",
                "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"],
            }
        ],
    }
    iam.put_user_policy(
        UserName="relaytrain-trainer",
        PolicyName="bucket",
        PolicyDocument=json.dumps(trainer_policy),
    )
    trainer_key = iam.create_access_key(UserName="relaytrain-trainer")["AccessKey"]
    client("s3", *admin).create_bucket(Bucket=bucket)
    try:  # the server really enforces credentials now
        client("s3", "unknown-access-key", "not-a-secret").list_objects_v2(Bucket=bucket)
    except ClientError as e:
        assert e.response["ResponseMetadata"]["HTTPStatusCode"] == 403, e.response
    else:
        raise RuntimeError("moto accepted an unknown access key: IAM auth is not enforced")
    return {
        "access_key_id": trainer_key["AccessKeyId"],
        "secret_access_key": trainer_key["SecretAccessKey"],
        "admin_key": admin,
        "trainer_user": "relaytrain-trainer",
    }


@contextlib.contextmanager
def moto_s3(log_dir: Path, bucket: str = "relaytrain") -> Iterator[S3Server]:
    """Start moto's server (IAM auth enforced) with ``bucket``; stop it on exit."""
    port = free_port()
    log_file = log_dir / f"moto-{port}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(BOOTSTRAP_ACTIONS)
    with log_file.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.moto_server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=Path(__file__).resolve().parents[1],
        )
    try:
        wait_until_answers(f"http://127.0.0.1:{port}/moto-api/", process, log_file, "moto server")
        users = _bootstrap(port, bucket)
        yield S3Server(port=port, bucket=bucket, log_file=log_file, process=process, **users)
    finally:
        stop(process)


#: Where the storage tests append their measured figures (not asserted).
TIMINGS_FILE = Path(__file__).resolve().parents[1] / "runs" / "object-storage-timings.jsonl"


def record_timing(case: str, **figures) -> None:
    TIMINGS_FILE.parent.mkdir(parents=True, exist_ok=True)
    with TIMINGS_FILE.open("a") as f:
        f.write(json.dumps({"case": case, "at": time.strftime("%Y-%m-%dT%H:%M:%S"), **figures}))
        f.write("\n")
