"""A dataset file whose bytes are damaged: told apart from storage failing, and named.

A file rewritten or cut short is caught before anything reads it (``dataset_snapshot``: its
size or footer moved). A byte flipped inside a data page keeps both: a disk, a copy or a
network path that damaged it leaves a file the snapshot still matches. Parquet's page checksums
(CRC32 of each page, which Spark writes by default and pyarrow with ``write_page_checksum``)
find it, and every read here verifies them; without them, a page that no longer decodes
(a page header, a compressed stream or a dictionary index gone wrong) finds some of it.

Either way a retry reads the same bytes and fails the same way: the read raises
``DataFileDamagedError`` (a ``SpecError``: no retry budget is spent, nothing in the run
directory changes) naming the file, the row group and the fix. Storage failing while it reads
(a connection reset, a refused request) is not damage: its error goes on unchanged, to be
retried as before.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pyarrow as pa

from trainer_core.errors import DataFileDamagedError

#: What the Parquet reader says when a page's bytes are wrong, in pyarrow 25's words (every
#: message seen flipping each byte of the pages of real files, under each codec): a page
#: checksum, a page header, a compressed stream, a page cut short, a level, an offset or a
#: dictionary index out of range, lengths that disagree.
DAMAGE_SIGNS = re.compile(
    r"checksum|thrift|page|decompress|codec|corrupt|end of stream|encoding|dictionary"
    r"|bit.width|level|byte_array|invalid data|decod|length|offset|indices",
    re.IGNORECASE,
)

#: What a storage client says when it, not the file, failed: pyarrow's S3 and GCS clients, the
#: HTTP stack under them. Never damage, whatever else the message holds.
STORAGE_SIGNS = re.compile(
    r"AWS Error|curl|GCS|google|HTTP|connect|timeout|timed out|When reading|When getting"
    r"|throttl|unavailable|reset by peer",
    re.IGNORECASE,
)


def is_damage(error: BaseException) -> bool:
    """Whether ``error``, raised decoding a Parquet row group, says the file's bytes are wrong:
    an Arrow array that will not build from them, or the Parquet reader refusing them; never a
    system call's failure (an ``errno``) nor a storage client's."""
    text = str(error)
    if STORAGE_SIGNS.search(text):
        return False
    if isinstance(error, pa.ArrowInvalid):
        return True
    return isinstance(error, OSError) and error.errno is None and bool(DAMAGE_SIGNS.search(text))


@contextlib.contextmanager
def named(dataset: str, file: str, row_group: int, first_row: int, rows: int) -> Iterator[None]:
    """Decoding row group ``row_group`` of ``file`` (rows ``first_row`` on, of ``dataset``'s
    ids): damage found in it becomes a ``DataFileDamagedError`` that names them."""
    try:
        yield
    except (OSError, pa.ArrowInvalid) as error:
        if not is_damage(error):
            raise
        raise DataFileDamagedError(
            f"data.dataset {dataset}: file {file!r} is damaged: its row group {row_group} "
            f"(dataset rows {first_row}..{first_row + rows - 1}) does not decode ({error}). A "
            "retry would read the same bytes, so none is made. Restore the file from its "
            "source (or a backup) and run the flow again: it resumes from the newest "
            "checkpoint, which nothing here touched. Or drop the file and start a new "
            "run.name.",
            field="data.dataset",
            file=file,
            row_group=row_group,
        ) from error
