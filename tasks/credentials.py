"""Storage credentials from a Prefect block (``run.credentials``), in the environment for a run.

``run.credentials`` names a block as ``<block-type-slug>/<block-name>``:

- ``secret/<name>``: Prefect's Secret block; its value is a JSON object of environment variable
  names to values, the names from ``trainer_core.storage.CREDENTIAL_ENV_VARS``
  (e.g. ``{"AWS_ACCESS_KEY_ID": "...", "AWS_SECRET_ACCESS_KEY": "..."}``);
- ``aws-credentials/<name>``: prefect-aws's AwsCredentials (key pair, session token, profile,
  region, ``aws_client_parameters.endpoint_url``);
- ``minio-credentials/<name>``: prefect-aws's MinIOCredentials (root user and password, region,
  endpoint).

``apply`` puts the block's variables into this process's environment, where pyarrow and s3fs
read them and where ``trainer_core.storage.credential_env()`` hands them to Ray's controller and
workers; ``restored`` puts the environment back when the flow ends. Only the block's *name*
travels in the spec; its values never go into parameters, logs, results or files (only the
variables' names are logged). The environment is process-wide: one flow at a time per process
should use a block (Prefect runs each flow run in its own process).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from trainer_core.errors import SpecError
from trainer_core.storage.locations import CREDENTIAL_ENV_VARS

FIELD = "run.credentials"


def _secret_env(name: str) -> dict[str, str]:
    from prefect.blocks.system import Secret

    value = _load(Secret, name).get()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise SpecError(
            f"Secret block {name!r} named by run.credentials must hold a JSON object of "
            'environment variable names to string values, e.g. {"AWS_ACCESS_KEY_ID": "...", '
            '"AWS_SECRET_ACCESS_KEY": "..."}: store that in the block',
            field=FIELD,
        )
    unknown = sorted(set(value) - set(CREDENTIAL_ENV_VARS))
    if unknown:
        raise SpecError(
            f"Secret block {name!r} named by run.credentials sets {unknown}, which are not "
            f"storage credential variables: use only {', '.join(CREDENTIAL_ENV_VARS)}",
            field=FIELD,
        )
    return dict(value)


def _aws_env(name: str) -> dict[str, str]:
    block = _load(_prefect_aws("AwsCredentials"), name)
    if block.assume_role_arn:
        raise SpecError(
            f"aws-credentials block {name!r} asks to assume role {block.assume_role_arn}, which "
            "the Ray workers cannot do from environment variables: store the role's temporary "
            "credentials (or a profile) in the block instead",
            field=FIELD,
        )
    secret = block.aws_secret_access_key
    return _without_empty(
        {
            "AWS_ACCESS_KEY_ID": block.aws_access_key_id,
            "AWS_SECRET_ACCESS_KEY": secret.get_secret_value() if secret else None,
            "AWS_SESSION_TOKEN": block.aws_session_token,
            "AWS_PROFILE": block.profile_name,
            **_region_and_endpoint(block),
        }
    )


def _minio_env(name: str) -> dict[str, str]:
    block = _load(_prefect_aws("MinIOCredentials"), name)
    return _without_empty(
        {
            "AWS_ACCESS_KEY_ID": block.minio_root_user,
            "AWS_SECRET_ACCESS_KEY": block.minio_root_password.get_secret_value(),
            **_region_and_endpoint(block),
        }
    )


#: Block type slug -> reader of its values as environment variables.
READERS: dict[str, Callable[[str], dict[str, str]]] = {
    "secret": _secret_env,
    "aws-credentials": _aws_env,
    "minio-credentials": _minio_env,
}


def block_env(ref: str) -> dict[str, str]:
    """The environment variables the block ``ref`` (``<type-slug>/<name>``) provides.

    Raises SpecError naming ``run.credentials`` for a malformed reference, an unsupported block
    type, a block that does not exist, or one whose values cannot be used.
    """
    slug, _, name = ref.partition("/")
    if not slug or not name:
        raise SpecError(
            f"run.credentials {ref!r} is not a block reference: write <block-type-slug>/"
            "<block-name>, e.g. aws-credentials/lake or secret/lake-keys",
            field=FIELD,
        )
    reader = READERS.get(slug)
    if reader is None:
        raise SpecError(
            f"run.credentials {ref!r} names a {slug!r} block, which relaytrain cannot read "
            f"credentials from: use one of {', '.join(sorted(READERS))}",
            field=FIELD,
        )
    return reader(name)


def apply(ref: str | None) -> list[str]:
    """Load block ``ref`` and set its variables in this process; returns their names.

    Call inside ``restored()`` so the environment is put back afterwards. None does nothing.
    """
    if ref is None:
        return []
    env = block_env(ref)
    os.environ.update(env)
    return sorted(env)


@contextlib.contextmanager
def restored() -> Iterator[None]:
    """Put every storage-credential variable back as it was on entry, on exit."""
    saved = {name: os.environ.get(name) for name in CREDENTIAL_ENV_VARS}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def using(ref: str | None) -> Iterator[list[str]]:
    """Block ``ref``'s variables in the environment while inside (names yielded)."""
    with restored():
        yield apply(ref)


# -- helpers -------------------------------------------------------------------------------------


def _load(block_class: Any, name: str) -> Any:
    slug = block_class.get_block_type_slug()
    try:
        return block_class.load(name)
    except ValueError as e:
        if "Unable to find block document" not in str(e):
            raise SpecError(
                f"run.credentials block {slug}/{name} could not be read: {type(e).__name__} "
                f"(save it again with `{block_class.__name__}(...).save({name!r})`)",
                field=FIELD,
            ) from None  # a validation message can quote the block's values
        raise SpecError(
            f"run.credentials names block {slug}/{name}, which does not exist on this Prefect "
            f"API: create it (`{block_class.__name__}(...).save({name!r})` or the UI's Blocks "
            "page), or fix run.credentials",
            field=FIELD,
        ) from e


def _prefect_aws(name: str) -> Any:
    try:
        import prefect_aws
    except ImportError as e:
        raise SpecError(
            "run.credentials names a prefect-aws block, but prefect-aws is not installed: "
            "`pip install prefect-aws`, or use a secret/<name> block",
            field=FIELD,
        ) from e
    return getattr(prefect_aws, name)


def _region_and_endpoint(block: Any) -> dict[str, str | None]:
    endpoint = getattr(block.aws_client_parameters, "endpoint_url", None)
    return {
        "AWS_DEFAULT_REGION": block.region_name,
        "AWS_REGION": block.region_name,
        "AWS_ENDPOINT_URL": str(endpoint) if endpoint else None,
    }


def _without_empty(env: dict[str, str | None]) -> dict[str, str]:
    return {k: v for k, v in env.items() if v}
