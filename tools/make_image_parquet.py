"""Write examples/data/digits_png.parquet: a real image set as encoded image bytes in Parquet.

The images are the 1,797 handwritten digits of the UCI set relaytrain ships
(trainer_core/builtin_data/digits.parquet, from scikit-learn's copy; CC BY 4.0): each 8x8
image of 17 grey levels, scaled to 0..255 and enlarged to ``--size`` pixels a side with
Pillow's bicubic filter, then encoded as PNG (``--format jpeg``: JPEG at quality 90). Columns:
``image`` (binary: the encoded file), ``label`` (int64, 0..9); written as pyarrow writes by
default (one row group).

    python tools/make_image_parquet.py [--size 32] [--format png]
        [--out examples/data/digits_png.parquet]
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

DIGITS = Path(__file__).resolve().parents[1] / "trainer_core" / "builtin_data" / "digits.parquet"


def encoded(pixels: np.ndarray, size: int, kind: str) -> bytes:
    grey = np.clip(np.round(pixels.reshape(8, 8) * 255 / 16), 0, 255).astype(np.uint8)
    image = Image.fromarray(grey, mode="L").resize((size, size), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    image.save(out, format=kind.upper(), **({"quality": 90} if kind == "jpeg" else {}))
    return out.getvalue()


def table(size: int = 32, kind: str = "png") -> pa.Table:
    digits = pq.read_table(DIGITS)
    pixels = np.asarray(digits.column("pixels").combine_chunks().flatten()).reshape(-1, 64)
    images = [encoded(p, size, kind) for p in pixels]
    return pa.table({"image": pa.array(images, pa.binary()), "label": digits.column("label")})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--format", choices=["png", "jpeg"], default="png")
    parser.add_argument("--out", default="examples/data/digits_png.parquet")
    args = parser.parse_args()
    rows = table(args.size, args.format)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(rows, args.out)
    print(f"{args.out}: {rows.num_rows} {args.format} images of {args.size}x{args.size}")


if __name__ == "__main__":
    main()
