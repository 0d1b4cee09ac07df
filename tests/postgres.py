"""A real PostgreSQL server (Debian's ``postgresql`` package) in a temporary directory on
loopback: initdb, pg_ctl start, a database and a password-authenticated user for the test.

Run as root (as CI does), the server runs as the ``postgres`` user the package creates, since
PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.net import free_port

USER = "relaytrain"


def bin_dir() -> Path:
    """Where initdb and pg_ctl are: on PATH, else Debian's /usr/lib/postgresql/VERSION/bin."""
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not versions:
        raise RuntimeError(
            "PostgreSQL's server is not installed: `make test` installs Debian's postgresql "
            "(tools/install.sh system), or run apt-get install postgresql"
        )
    return Path(versions[-1]).parent


class Postgres:
    def __init__(self) -> None:
        # not under pytest's 0700 tmp dirs: the postgres user must be able to reach it
        self.root = Path(tempfile.mkdtemp(prefix="relaytrain-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.password = secrets.token_hex(16)
        self.bin = bin_dir()
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]

    def url(self, driver: str = "postgresql+asyncpg", database: str = "prefect") -> str:
        return f"{driver}://{USER}:{self.password}@127.0.0.1:{self.port}/{database}"

    def _run(self, *command: str, env: dict[str, str] | None = None) -> None:
        done = subprocess.run(
            [*self.as_user, *command],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **(env or {})},
            cwd=self.root,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stdout}{done.stderr}")

    def start(self) -> Postgres:
        password_file = self.root / "password"
        password_file.write_text(self.password)
        if self.as_user:
            shutil.chown(password_file, "postgres")
        self._run(
            str(self.bin / "initdb"),
            "-D",
            str(self.data),
            "-U",
            USER,
            "--pwfile",
            str(password_file),
            "--auth-host=scram-sha-256",
            "--auth-local=scram-sha-256",
            "--encoding=UTF8",
            "--no-instructions",
        )
        password_file.unlink()
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            str(self.bin / "pg_ctl"),
            "-D",
            str(self.data),
            "-o",
            options,
            "-l",
            str(self.root / "server.log"),
            "-w",
            "start",
        )
        self.create_database("prefect")
        return self

    def create_database(self, name: str) -> None:
        self._run(
            str(self.bin / "createdb"),
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            USER,
            name,
            env={"PGPASSWORD": self.password},
        )

    def query(self, sql: str) -> list[tuple]:
        """Rows of ``sql``, read with asyncpg (Prefect's own driver), as another client."""
        import asyncio

        import asyncpg

        async def fetch() -> list[tuple]:
            connection = await asyncpg.connect(self.url("postgresql"))
            try:
                return [tuple(row) for row in await connection.fetch(sql)]
            finally:
                await connection.close()

        return asyncio.run(fetch())

    def stop(self) -> None:
        if self.data.exists():
            subprocess.run(
                [
                    *self.as_user,
                    str(self.bin / "pg_ctl"),
                    "-D",
                    str(self.data),
                    "-m",
                    "fast",
                    "stop",
                ],
                capture_output=True,
                timeout=60,
                cwd=self.root,
            )
        shutil.rmtree(self.root, ignore_errors=True)
