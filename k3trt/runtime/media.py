"""Images in requests: from what a caller gives to what the step loop runs.

    intake = ImageIntake.open(model, session, tokenizer, limits)   # model.vision: the tower, or None
    prompt = intake.prepare(ids, sources)        # MediaPrompt: ids widened, images preprocessed
    prompt = intake.prepare(ids, urls, files=FilePolicy(allowed_dir=...))   # untrusted (the server)

A prompt holds one placeholder (the model's ``media_placeholder_token_id``, chat's MEDIA_PAD) per
image, in order; ``prepare`` widens each to the image's token count (``num_image_tokens`` of its
grid) and keeps, per image, its pixel values, grid, the sha256 of its bytes (the prefix cache keys
the blocks holding its placeholders with it) and where its placeholders sit. An image source is a
PIL image, bytes, a path, or a string: a ``data:`` URL, a ``file://`` URL or a path (local files
only as ``FilePolicy`` allows); http(s) URLs are refused (nothing is fetched). Every refusal is a
RequestError naming ``images``.

The encoder runs in the step loop (``encode``), once per image, on the plan's ``encodes`` (the
scheduler picks them under its encoder budget); the embeddings stay on the request until its
prefill has passed them (``release_passed``), and ``chunk_embeds`` gives a prefill step the rows
they replace; ``request_embeds`` gives a chunk's rows by prompt position (the MTP drafter's
copy, speculative/mtp.py).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from k3trt.runtime.params import RequestError

if TYPE_CHECKING:
    from k3trt.runtime.request import Request
    from k3trt.runtime.scheduler import Chunk

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageLimits:
    max_image_bytes: int = 20 << 20         # an image's encoded bytes (a data URL's decoded payload)
    max_image_pixels: int = 1 << 26         # width x height before the resize: decompression bombs
    max_encoder_tokens: int = 0             # image tokens encoded per step (an image must fit)


@dataclass(frozen=True)
class FilePolicy:
    """Which local files an image source may name: any (the Python API, `k3trt run`), none, or
    only those under `allowed_dir` (the server's --allowed-media-dir)."""
    local: bool = True
    allowed_dir: Path | None = None


UNTRUSTED = FilePolicy(local=False)

# step graphs that read input_ids only: TensorRT's, and onnx ones built without encoder capacities
NO_EMBEDS = ("this engine's step graphs take token ids only, not image embeddings: serve images from a torch "
             "engine dir (k3trt build --backend torch) or an onnx one built with --encoder-capacities")


@dataclass(frozen=True)
class ImageInput:
    pixel_values: torch.Tensor     # float [n_patches, 3, p, p]
    grid_thw: torch.Tensor         # int64 [3]
    sha256: bytes                  # of its bytes (a PIL image: of its mode, size and pixels)
    offset: int                    # its first placeholder in the prompt
    num_tokens: int                # its placeholders = the encoder's rows for it

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass(frozen=True)
class MediaPrompt:
    """A prompt ready for the engine: ids with every image's placeholders, and the images."""
    ids: list[int]
    images: tuple[ImageInput, ...] = field(default=())


def _bad(message: str) -> RequestError:
    return RequestError("images", message)


def _data_url(url: str, max_bytes: int) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise _bad("a data: URL must be base64 (data:image/png;base64,...)")
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise _bad(f"the image is over this engine's limit of {max_bytes} bytes (max_image_bytes)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("the data: URL's payload is not valid base64") from None


def _local_file(path: Path, files: FilePolicy, max_bytes: int) -> bytes:
    if not files.local and files.allowed_dir is None:
        raise _bad("local files are not served here: send the image as a data: URL (a server reads files "
                   "only under its --allowed-media-dir)")
    real = path.expanduser().resolve()
    if files.allowed_dir is not None and not real.is_relative_to(files.allowed_dir.resolve()):
        raise _bad(f"{path} is outside the allowed media directory")
    if not real.is_file():
        raise _bad(f"{path}: no such image file")
    if real.stat().st_size > max_bytes:
        raise _bad(f"{path} is {real.stat().st_size} bytes, over this engine's limit of {max_bytes} bytes "
                   "(max_image_bytes)")
    return real.read_bytes()


def read_source(source: Any, files: FilePolicy, max_bytes: int) -> Any:
    """The bytes an image source names (a PIL image is returned as is)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, Path):
        data = _local_file(source, files, max_bytes)
    elif isinstance(source, str):
        scheme = source.split(":", 1)[0].lower() if ":" in source[:12] else ""
        if scheme == "data":
            data = _data_url(source, max_bytes)
        elif scheme in ("http", "https"):
            raise _bad("remote image URLs are not fetched: send the image as a data: URL")
        elif scheme == "file":
            data = _local_file(Path(source[len("file://"):]), files, max_bytes)
        elif scheme and "://" in source:
            raise _bad(f"image URL scheme {scheme!r} is not supported (data:, file://)")
        else:
            data = _local_file(Path(source), files, max_bytes)
    elif hasattr(source, "tobytes") and hasattr(source, "convert"):     # a PIL image (Pillow comes with the tower)
        return source
    else:
        raise _bad(f"an image must be a PIL image, bytes, a path or a data: URL, got {type(source).__name__}")
    if len(data) > max_bytes:
        raise _bad(f"the image is {len(data)} bytes, over this engine's limit of {max_bytes} bytes (max_image_bytes)")
    return data


class ImageIntake:
    """Turns (prompt ids, image sources) into a MediaPrompt for one model; `reason` says why an
    engine takes no images (then every image request is refused with it); `max_patches`: the most
    patches one image may have (an engine's largest encoder graph), None: any."""

    def __init__(self, api: Any, vcfg: Any, placeholder: int | None, limits: ImageLimits, reason: str | None = None,
                 max_patches: int | None = None):
        self.api, self.vcfg, self.placeholder, self.limits, self.reason = api, vcfg, placeholder, limits, reason
        self.max_patches = max_patches

    @classmethod
    def open(cls, model: torch.nn.Module | None, session: Any, limits: ImageLimits) -> "ImageIntake":
        """`model`: the torch model (its tower), or None for an engine backend (the session's cfg)."""
        if not getattr(session, "takes_embeds", False):
            return cls(None, None, None, limits, NO_EMBEDS)
        cfg = model.cfg if model is not None else session.cfg
        if (getattr(model, "vision", None) if model is not None else cfg.vision) is None:
            return cls(None, None, None, limits, "this model has no vision tower")
        if cfg.media_placeholder_token_id is None:
            return cls(None, None, None, limits, "the model's config has no media_placeholder_token_id")
        import k3trt.model.vision as api  # noqa: PLC0415 (the tower's module: only for a model that has one)
        return cls(api, cfg.vision, cfg.media_placeholder_token_id, limits,
                   max_patches=getattr(session, "max_image_patches", None))

    def prepare(self, ids: Sequence[int], sources: Sequence[Any], files: FilePolicy = FilePolicy()) -> MediaPrompt:
        ids = list(ids)
        if not sources:
            return MediaPrompt(ids)
        if self.reason is not None:
            raise _bad(self.reason)
        at = [i for i, t in enumerate(ids) if t == self.placeholder]
        if len(at) != len(sources):
            raise _bad(f"the prompt holds {len(at)} image placeholders (token {self.placeholder}, <|media_pad|>) for "
                       f"{len(sources)} images: put one placeholder where each image goes")
        lim = self.limits
        raw = [read_source(s, files, lim.max_image_bytes) for s in sources]
        pics, digests = [], []
        for i, r in enumerate(raw):
            try:
                if isinstance(r, bytes):
                    pic, digest = self.api.load_image(r, max_bytes=lim.max_image_bytes,
                                                      max_pixels=lim.max_image_pixels), hashlib.sha256(r).digest()
                else:
                    if r.width * r.height > lim.max_image_pixels:
                        raise ValueError(f"{r.width}x{r.height} pixels; the limit is {lim.max_image_pixels}")
                    pic = r.convert("RGB")
                    digest = hashlib.sha256(f"{pic.size}".encode() + pic.tobytes()).digest()
            except ValueError as e:          # the tower's ImageError is a ValueError
                raise _bad(f"image {i}: {e}") from None
            pics.append(pic)
            digests.append(digest)
        pixel_values, grids = self.api.preprocess(pics, self.vcfg)
        out, images, prev, patch0 = [], [], 0, 0
        for i, (pos, grid) in enumerate(zip(at, grids)):
            n = int(self.api.num_image_tokens(self.vcfg, grid))
            if n > lim.max_encoder_tokens:
                raise _bad(f"image {i} makes {n} image tokens; this engine encodes at most {lim.max_encoder_tokens} "
                           "per step (max_encoder_tokens)")
            patches = int(torch.prod(grid))
            if self.max_patches is not None and patches > self.max_patches:
                raise _bad(f"image {i} has {patches} patches; this engine's largest encoder graph holds "
                           f"{self.max_patches} (build it with larger --encoder-capacities, or send a smaller image)")
            out += ids[prev:pos]
            images.append(ImageInput(pixel_values[patch0:patch0 + patches], grid, digests[i], len(out), n))
            out += [self.placeholder] * n
            prev, patch0 = pos + 1, patch0 + patches
        return MediaPrompt(out + ids[prev:], tuple(images))


def split_prompt(prompt: Any, intake: ImageIntake, tokenizer: Any) -> tuple[Any, tuple[ImageInput, ...]]:
    """A request's prompt as (text or ids, images): a MediaPrompt as it is, a mapping
    ``{"prompt": text | ids, "images": [sources]}`` prepared here (text encoded with special-token
    strings recognised, so "<|media_pad|>" marks an image), anything else without images."""
    if isinstance(prompt, MediaPrompt):
        return prompt.ids, prompt.images
    if not isinstance(prompt, Mapping):
        return prompt, ()
    unknown = sorted(set(prompt) - {"prompt", "images"})
    if unknown or "prompt" not in prompt:
        raise RequestError("prompt", f"a prompt mapping holds `prompt` and `images`; got {sorted(prompt)}")
    text, sources = prompt["prompt"], prompt.get("images") or []
    if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence):
        sources = [sources]
    if isinstance(text, str):
        if tokenizer is None:
            raise RequestError("prompt", "text prompts need the engine's tokenizer (the engine dir has none); "
                                         "pass token ids")
        text = tokenizer.encode(text, allow_special=True)
    p = intake.prepare(text.tolist() if isinstance(text, torch.Tensor) else list(text), sources)
    return p.ids, p.images


# ---------------------------------------------------------------------------- in the step loop
def encode(session: Any, encodes: list[tuple["Request", int]]) -> None:
    """Run the encoder once over every (request, image) of the step; each request keeps its rows."""
    if not encodes:
        return
    images = [req.images[i] for req, i in encodes]
    rows = session.encode_images(torch.cat([im.pixel_values for im in images]),
                                 torch.stack([im.grid_thw for im in images]))
    at = 0
    for (req, i), im in zip(encodes, images):
        req.image_embeds[i] = rows[at:at + im.num_tokens]
        at += im.num_tokens
    if at != rows.shape[0]:
        raise RuntimeError(f"the vision encoder gave {rows.shape[0]} rows for {at} image tokens")


def request_embeds(req: "Request", start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(positions int64 [N], embeddings [N, hidden]) of the request's image placeholders in
    [start, end), or None when there are none there."""
    positions, values = [], []
    for i, im in enumerate(req.images):
        lo, hi = max(im.offset, start), min(im.end, end)
        if lo >= hi:
            continue
        emb = req.image_embeds.get(i)
        if emb is None:
            raise RuntimeError(f"request {req.request_id}: image {i} was not encoded before its prefill")
        positions.append(torch.arange(lo, hi))
        values.append(emb[lo - im.offset:hi - im.offset])
    return (torch.cat(positions), torch.cat(values)) if positions else None


def chunk_embeds(chunks: list["Chunk"]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows int64 [N] of the step's flat tokens, embeddings [N, hidden]) for every image
    placeholder in these prefill chunks, or None when they hold none."""
    rows, values, t0 = [], [], 0
    for c in chunks:
        got = request_embeds(c.req, c.start, c.start + c.num_tokens)
        if got is not None:
            rows.append(got[0] - c.start + t0)
            values.append(got[1])
        t0 += c.num_tokens
    return (torch.cat(rows), torch.cat(values)) if rows else None


def release_passed(req: "Request", computed: int) -> None:
    """Drop the embeddings of images whose placeholders all lie before `computed`."""
    for i in [i for i in req.image_embeds if req.images[i].end <= computed]:
        del req.image_embeds[i]


def media_key(req: "Request", start: int, end: int) -> bytes:
    """The sha256 of every image with a placeholder in [start, end): a prefix-cache block's extra key."""
    return b"".join(im.sha256 for im in req.images if im.offset < end and im.end > start)
