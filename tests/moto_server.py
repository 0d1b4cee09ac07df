"""moto's S3 server (``python -m moto.server``) with conditional PutObject made atomic.

moto 5.2 checks ``If-None-Match`` / ``If-Match`` and then writes, with nothing held between the
two, in a threaded server (``moto/s3/responses.py``, ``S3Response.put_object``): of conditional
writes of one absent key racing, more than one can succeed. AWS S3 lets exactly one succeed and
answers the others 412 (as MinIO and LocalStack do, under a lock), and the run lease relies on
it (``trainer_core/storage/conditional_write.py``); the full suite's lease race saw two winners
on moto (``tests/integration/test_lease.py``). This serialises conditional PutObjects; all else
is moto as shipped. Run from the repository: ``python -m tests.moto_server -H 127.0.0.1 -p PORT``.
"""

from __future__ import annotations

import threading
from typing import Any

from moto.s3.responses import S3Response
from moto.server import main

_conditional = threading.Lock()
_put_object = S3Response.put_object


def put_object(self: S3Response) -> Any:
    if self.headers.get("If-None-Match") or self.headers.get("If-Match"):
        with _conditional:
            return _put_object(self)
    return _put_object(self)


S3Response.put_object = put_object  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
