"""``load_image``: an image from bytes or a local path, never the network, with a byte limit, a
pixel limit checked from the header before decoding (Pillow's decompression-bomb guard stays on
as well), and one error type whose message says what is wrong and what to do."""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image, UnidentifiedImageError

# Pillow decodes many formats; these are the ones an image chat sends.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


class ImageError(ValueError):
    """An image that cannot be used: corrupt, too large, or not a supported format (the message
    names the problem and the remedy)."""


def load_image(source: bytes | str | Path, *, max_bytes: int, max_pixels: int) -> Image.Image:
    """The decoded image (first frame of an animation), fully read. `source`: the encoded bytes,
    or a local file path (str / Path); URLs are refused."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data, where = bytes(source), "image data"
    elif isinstance(source, (str, Path)):
        text = str(source)
        if "://" in text or text.startswith("data:"):
            raise ImageError(f"{text[:60]!r} is a URL; images are read from bytes or local files only "
                             "(pass the decoded bytes of a data URL, or download the image first)")
        path = Path(text)
        if not path.is_file():
            raise ImageError(f"image file {path} does not exist or is not a file")
        size = path.stat().st_size
        if size > max_bytes:
            raise ImageError(f"image file {path} is {size} bytes, over the limit of {max_bytes}; "
                             "send a smaller or more compressed image")
        data, where = path.read_bytes(), f"image file {path}"
    else:
        raise ImageError(f"an image is bytes or a file path, got {type(source).__name__}")
    if len(data) > max_bytes:
        raise ImageError(f"{where} is {len(data)} bytes, over the limit of {max_bytes}; "
                         "send a smaller or more compressed image")
    if not data:
        raise ImageError(f"{where} is empty")
    # Pillow's own decompression-bomb guard (an error past 2 × Image.MAX_IMAGE_PIXELS) stays on;
    # the pixel limit is checked from the header, before any pixel is decoded
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
        w, h = img.size
        if w * h > max_pixels:
            raise ImageError(f"{where} is {w}×{h} = {w * h} pixels, over the limit of {max_pixels}; "
                             "send a smaller image")
        img.load()
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"{where} is not an image in a supported format ({', '.join(FORMATS)}); "
                         "convert it to PNG or JPEG") from None
    except Image.DecompressionBombError as e:
        raise ImageError(f"{where} is too large to decode safely ({e}); send a smaller image") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"{where} is corrupt or truncated ({e}); send the complete image again") from None
    if w < 1 or h < 1:
        raise ImageError(f"{where} has no pixels ({w}×{h})")
    return img
