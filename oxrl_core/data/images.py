"""Images in rows: decoding a row's ``images`` into RGB PIL images, and checking where an image row puts them.

A row of any prompt-side format may carry ``images``: a list whose entries are each

- a local path, absolute or relative to the data file the row came from (``~`` expanded): a regular file of at most
  `MAX_IMAGE_MB` (a FIFO, a device or a multi-GB file given by mistake is refused, never read); a URL is refused
  (oxRL works offline: it fetches nothing),
- a base64 string, bare or as a ``data:image/...;base64,`` URI,
- ``{"bytes": ..., "path": ...}`` -- how a `datasets` ``Image`` feature stores an image and what a Parquet file of
  one holds; ``bytes`` wins when both are set, else ``path`` is read as above,
- raw ``bytes``, or an already decoded PIL image (a `datasets` ``Image`` feature that decodes).

Each image has a place in the prompt: a ``{"type": "image"}`` content part in a system or user message, or an
``<image>`` marker (`IMAGE_MARKER`) in a ``prompt`` string; the i-th placeholder is the i-th image. Images go on the
prompt side only: the model reads them, it never writes them, so an image part in an assistant turn or a marker in
``response`` / ``chosen`` / ``rejected`` / ``completion`` is refused (`check_image_row`), as is a row whose number
of placeholders differs from its number of images (the processor would fail far from the row, or worse, the model
would pair features with the wrong tokens: "Image features and image tokens do not match").

Every image becomes 8-bit RGB: 16-bit and 32-bit integer images (``I;16``, ``I``: a 16-bit PNG) are scaled by
65535 → 255, float images (``F``) with values in [0, 1] by 1 → 255 (PIL's own ``convert("RGB")`` clips them at 255,
which turns a 16-bit picture almost white); an ``I`` image with values outside 0..65535 or an ``F`` one outside
[0, 1] has no scale to read it at and is refused, naming the row.

Every problem is an `OxrlError` naming the file, the row and the field, like `rows.normalise_row`'s. Nothing here
imports PIL at module level (the data layer loads without it for text runs).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import stat
from pathlib import Path

from oxrl_core.data.rows import row_where
from oxrl_core.errors import OxrlError

#: the placeholder for one image in a ``prompt`` string (chat messages use ``{"type": "image"}`` parts instead)
IMAGE_MARKER = "<image>"
#: the completion fields of the row formats: never an image there
RESPONSE_FIELDS = ("response", "chosen", "rejected", "completion")
#: what an ``images`` entry may be, for messages
IMAGE_KINDS = 'a local path, a base64 string, {"bytes": ...} or a PIL image'

#: the largest image file read (MB): a bigger one is refused, naming the row (a wrong path, not a picture)
MAX_IMAGE_MB = 64
#: a URL in ``images``: ``scheme://...``
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_FILE_KINDS = {
    stat.S_ISDIR: "a directory",
    stat.S_ISFIFO: "a FIFO",
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
    stat.S_ISSOCK: "a socket",
}
_BASE64 = re.compile(r"[A-Za-z0-9+/=\s_-]+")
_DATA_URI = re.compile(r"data:image/[\w.+-]+;base64,", re.IGNORECASE)


def image_base_dir(row: dict, origin: str) -> Path | None:
    """The directory relative image paths of ``row`` are read from: that of the data file the row came from
    (``_origin``, set per file by `sources`), or None (the working directory) for rows not from a file."""
    source = Path(str(row.get("_origin", origin)))
    try:
        if source.is_file():
            return source.parent
        if source.is_dir():
            return source
    except OSError:  # a hub id or a name the OS cannot look up: not a file
        return None
    return None


def _open(data: bytes, where: str, field: str, what: str):
    """Decode image bytes to an RGB PIL image, or an error saying which entry could not be decoded and why."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return to_rgb(image, where, field)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        reason = re.sub(r" <_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", str(exc)) or type(exc).__name__
        raise OxrlError(f"{where}: field '{field}': cannot decode {what} as an image ({reason})") from None


def to_rgb(image, where: str, field: str):
    """``image`` as 8-bit RGB, scaled from 16-bit, 32-bit integer and float modes (the module docstring)."""
    from PIL import Image

    if image.mode not in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        return image.convert("RGB")
    import numpy as np

    values = np.asarray(image, dtype=np.float64)
    low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
    top = 1.0 if image.mode == "F" else 65535.0
    if low < 0 or high > top or not np.isfinite(values).all():
        raise OxrlError(
            f"{where}: field '{field}': a {image.mode} image with values {low:g}..{high:g}, outside 0..{top:g}, has no "
            "known scale to 8 bits; give an 8-bit or 16-bit image"
        )
    gray = np.rint(values * (255.0 / top)).astype(np.uint8)
    return Image.fromarray(gray).convert("RGB")  # (H, W) uint8: mode L


def _looks_like_base64(text: str) -> bool:
    """Long and of the base64 alphabet only (a file name has a dot before its extension)."""
    return len(text) >= 32 and "." not in text and _BASE64.fullmatch(text) is not None


def _from_base64(payload: str, where: str, field: str):
    payload = "".join(payload.split())
    payload += "=" * (-len(payload) % 4)
    try:
        if "-" in payload or "_" in payload:  # the URL-safe alphabet
            data = base64.urlsafe_b64decode(payload)
        else:
            data = base64.b64decode(payload)
    except (binascii.Error, ValueError) as exc:
        raise OxrlError(f"{where}: field '{field}': cannot decode the base64 string ({exc})") from None
    return _open(data, where, field, "the base64 string")


def _from_string(text: str, base: Path | None, where: str, field: str):
    """A data URI, a path (relative to ``base``) or a base64 string -> an RGB PIL image. A string that names an
    existing file is a path, even where it could be read as base64."""
    uri = _DATA_URI.match(text)
    if uri:
        return _from_base64(text[uri.end() :], where, field)
    if _URL.match(text):
        raise OxrlError(
            f"{where}: field '{field}': {text[:200]!r} is a URL, not fetched (oxRL works offline): give local paths, "
            "base64 or bytes"
        )
    path = Path(text).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    try:
        data = _read_image_file(path, where, field)
    except FileNotFoundError:
        if _looks_like_base64(text):
            return _from_base64(text, where, field)
        raise OxrlError(
            f"{where}: field '{field}': no such file {path} (a relative path is read from the data file's directory)"
        ) from None
    except OSError as exc:  # a directory, no permission, a name too long for a path (then maybe base64)
        if _looks_like_base64(text):
            return _from_base64(text, where, field)
        raise OxrlError(f"{where}: field '{field}': cannot read {path} ({exc.strerror or exc})") from None
    return _open(data, where, field, str(path))


def _read_image_file(path: Path, where: str, field: str) -> bytes:
    """The bytes of a regular file of at most `MAX_IMAGE_MB`; a FIFO (which would block), a device (``/dev/zero``
    never ends) or a bigger file is refused without reading it."""
    info = path.stat()
    kind = next((name for test, name in _FILE_KINDS.items() if test(info.st_mode)), None)
    if kind is not None or not stat.S_ISREG(info.st_mode):
        raise OxrlError(f"{where}: field '{field}': {path} is {kind or 'not a regular file'}, not an image file")
    limit = MAX_IMAGE_MB * 2**20
    with path.open("rb") as handle:
        data = handle.read(limit + 1)  # bounded also where the size lies (/proc files say 0)
    if len(data) > limit:
        raise OxrlError(
            f"{where}: field '{field}': {path} is larger than {MAX_IMAGE_MB} MB, the most an image file may be (a "
            "wrong path?)"
        )
    return data


def decode_image(value, base: Path | None, where: str, field: str):
    """One ``images`` entry (see the module docstring) -> an RGB PIL image.

    ``where`` is the row (`rows.row_where`), ``field`` the entry (``images[1]``); both are named by any error:
    ``d.jsonl: row 3: field 'images[1]': cannot decode ...`` or ``...: field 'images[0]': no such file ...``."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return to_rgb(value, where, field)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _open(bytes(value), where, field, "the bytes")
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            if not isinstance(value["bytes"], (bytes, bytearray, memoryview)):
                raise OxrlError(
                    f"{where}: field '{field}.bytes' must be bytes, got {type(value['bytes']).__name__} (give a "
                    "base64 string as the entry itself)"
                )
            return _open(bytes(value["bytes"]), where, field, "the bytes")
        if isinstance(value.get("path"), str) and value["path"]:
            return _from_string(value["path"], base, where, field)
        raise OxrlError(f"{where}: field '{field}': an image object needs 'bytes' or 'path', got keys {sorted(value)}")
    if isinstance(value, str) and value.strip():
        return _from_string(value.strip(), base, where, field)
    raise OxrlError(f"{where}: field '{field}' must be {IMAGE_KINDS}, got {type(value).__name__}")


def _image_entries(row: dict, where: str) -> list:
    """The row's ``images`` list as given (none when absent or null), or an error naming the field."""
    value = row.get("images")
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise OxrlError(f"{where}: field 'images' must be a list of images ({IMAGE_KINDS}), got {type(value).__name__}")
    return list(value)


def picture_tensors(images: list) -> list:
    """PIL images -> (H, W, 3) uint8 RGB tensors: the pictures a backend that expands images itself (vLLM) is given,
    as tensors so a checkpoint's state files load them (`encode.image_fields`, `rl.episodes`)."""
    import numpy as np
    import torch

    return [torch.from_numpy(np.array(image.convert("RGB"))) for image in images]


def row_images(row: dict, origin: str) -> list:
    """The row's ``images`` decoded to RGB PIL images, in order; relative paths read from the data file's
    directory (`image_base_dir`). A row without ``images`` (or with null) has none."""
    if row.get("images") is None:
        return []
    where = row_where(row, origin)
    value = _image_entries(row, where)
    base = image_base_dir(row, origin)
    return [decode_image(entry, base, where, f"images[{i}]") for i, entry in enumerate(value)]


# ----------------------------------------------------------------------------- placeholders


def _is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


#: the content parts a message may hold, for messages
PART_SHAPES = '{"type": "text", "text": ...} or {"type": "image"}'


def prompt_text(prompt):
    """What a text-only reader (a reward model, an LLM judge) sees of a prompt: a string as it is (its images are
    its ``<image>`` markers); chat messages with each content given as text, its text parts joined and each image
    part shown as an ``<image>`` marker. Anything else comes back unchanged."""
    if not isinstance(prompt, list):
        return prompt
    out = []
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            text = "".join(
                IMAGE_MARKER
                if _is_image_part(part)
                else (part.get("text") or "")
                if isinstance(part, dict)
                else str(part)
                for part in content
            )
            message = {**message, "content": text}
        out.append(message)
    return out


def _message_image_parts(messages, field: str, where: str) -> int:
    """The number of image parts in the system/user/tool turns of ``messages`` (``field``), each list content
    checked part by part: an object of type ``text`` (with string ``text``), ``image`` or ``image_url``; keys that
    are null are absent (Parquet and `datasets` give every part every key). An image part in an assistant turn is
    an error naming it (``messages[2].content[0]``)."""
    if not isinstance(messages, list):
        return 0
    count = 0
    for j, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for k, part in enumerate(content):
            here = f"{field}[{j}].content[{k}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                continue
            if kind == "text":
                raise OxrlError(f"{where}: field '{here}.text' must be a string, got {type(part.get('text')).__name__}")
            if not _is_image_part(part):
                got = f"type {kind!r}" if isinstance(part, dict) else type(part).__name__
                raise OxrlError(f"{where}: field '{here}' must be {PART_SHAPES}, got {got}")
            if message.get("role") == "assistant":
                raise OxrlError(
                    f"{where}: field '{here}': an image in an assistant turn; images go on the prompt side only (a "
                    "system or user turn)"
                )
            count += 1
    return count


def _marker_count(value) -> int:
    """``<image>`` markers in a string, or in the string contents and text parts of a list of messages."""
    if isinstance(value, str):
        return value.count(IMAGE_MARKER)
    if not isinstance(value, list):
        return 0
    count = 0
    for message in value:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            count += content.count(IMAGE_MARKER)
        elif isinstance(content, list):
            count += sum((p.get("text") or "").count(IMAGE_MARKER) for p in content if isinstance(p, dict))
    return count


def is_image_row(row: dict) -> bool:
    """True for a row that carries images or image parts (``images`` non-empty, or a ``{"type": "image"}`` part in
    its ``prompt`` or ``messages``)."""
    if row.get("images"):
        return True
    return any(
        isinstance(message, dict)
        and isinstance(message.get("content"), list)
        and any(_is_image_part(p) for p in message["content"])
        for field in ("prompt", "messages")
        if isinstance(row.get(field), list)
        for message in row[field]
    )


def check_image_row(row: dict, origin: str) -> int:
    """Check where an image row puts its images; returns its number of images (0 for a text row).

    Refused, naming the field: an image part in an assistant turn (of ``messages`` or a ``prompt`` list); with
    ``images``, an ``<image>`` marker in a completion field (`RESPONSE_FIELDS`) or in an assistant turn; and a
    number of placeholders (image parts + ``<image>`` markers on the prompt side) other than the number of images,
    both counts named. Decoding the images is `row_images`' (this check reads no file)."""
    where = row_where(row, origin)
    # the prompt side is ``prompt`` when the row has one (a checked ``messages`` row gets its prompt from it), else
    # ``messages``; an image in an assistant turn of either is refused
    side = "prompt" if "prompt" in row else "messages"
    parts = {f: _message_image_parts(row.get(f), f, where) for f in ("messages", "prompt")}[side]
    images = _image_entries(row, where)
    if not images and not parts:
        return 0
    for field in RESPONSE_FIELDS:
        if isinstance(row.get(field), str) and IMAGE_MARKER in row[field]:
            raise OxrlError(
                f"{where}: field '{field}': holds an {IMAGE_MARKER} marker; images go on the prompt side only "
                f"(an {IMAGE_MARKER} marker in 'prompt' or an image part in a user turn)"
            )
    for field in ("messages", "prompt"):
        for j, message in enumerate(row.get(field) if isinstance(row.get(field), list) else []):
            if isinstance(message, dict) and message.get("role") == "assistant" and _marker_count([message]):
                raise OxrlError(
                    f"{where}: field '{field}[{j}]': an {IMAGE_MARKER} marker in an assistant turn; images go on "
                    "the prompt side only (a system or user turn)"
                )
    markers = _marker_count(row.get(side))
    placeholders = parts + markers
    if placeholders != len(images):
        kinds = " + ".join(
            what for what, n in (('{"type": "image"} parts', parts), (f"{IMAGE_MARKER} markers", markers)) if n
        )
        raise OxrlError(
            f"{where}: field 'images': {len(images)} image(s) but {placeholders} image placeholder(s) in the prompt"
            f'{f" ({kinds})" if kinds else ""}; give one {{"type": "image"}} part or {IMAGE_MARKER} marker per '
            "image, in order"
        )
    return len(images)


# ----------------------------------------------------------------------------- pixels in micro-batches

#: the keys an example of an image row carries beside its tokens (`encode.image_fields`)
IMAGE_FIELDS = ("pixel_inputs", "token_inputs", "pixels_by")
#: the key of an episode's media record that holds the images its environment showed, as rollouts.jsonl logs them
#: (`rl.turns.Episode.media`; no model input: `collate_pixels` does not read it)
ENV_IMAGES = "env_images"


def image_fields_of(example: dict) -> dict:
    """An example's image fields (`IMAGE_FIELDS`); {} for a text row."""
    return {k: example[k] for k in IMAGE_FIELDS if k in example}


#: processor outputs with one value per token (padded and cut with ``input_ids``; 0 on text tokens and padding):
#: Qwen-VL ``mm_token_type_ids``, Gemma-3 ``token_type_ids``
TOKEN_INPUTS = ("mm_token_type_ids", "token_type_ids")


def collate_pixels(examples: list[dict], width: int, left: bool = False, packed: bool = False) -> dict:
    """The image inputs of a micro-batch, from its rows' own (an example with images holds ``pixel_inputs``: the
    processor's tensors for that row, ``token_inputs``: lists of one value per token, and ``pixels_by``).

    A micro-batch is always assembled from whole rows, so a row's pixels travel with its tokens whichever rows share
    its micro-batch: never a batch tensor sliced by a row count. Per-token inputs become (B, width), padded with 0 on
    the right (``left``: on the left, for generation); ``packed``: (1, ΣL), row after row, as `batching.collate`
    packs the tokens. Pixel inputs are joined row after row, by what their first
    dimension counts (``pixels_by``): ``patch`` (Qwen-VL: patches, with one ``image_grid_thw`` row per image) and
    ``image`` (one entry per image) are concatenated; ``row`` (Idefics3: (1, tiles, ...) per row) is padded with
    zero tiles to the most tiles of the batch (a zero tile, with a zero ``pixel_attention_mask``, is skipped by the
    model) and concatenated. Rows without images add nothing. Returns {} when no row has image inputs."""
    import torch

    token_names = sorted({k for ex in examples for k in ex.get("token_inputs", {})})
    out: dict = {}
    for name in token_names if packed else ():
        values = []
        for ex in examples:
            row = list(ex.get("token_inputs", {}).get(name, ()))[: len(ex["input_ids"])]
            values += row + [0] * (len(ex["input_ids"]) - len(row))
        out[name] = torch.tensor([values], dtype=torch.long)
    for name in token_names if not packed else ():
        values = torch.zeros((len(examples), width), dtype=torch.long)
        for i, ex in enumerate(examples):
            row = ex.get("token_inputs", {}).get(name)
            if row:
                if left:
                    values[i, width - len(row) :] = torch.tensor(row)
                else:
                    values[i, : len(row)] = torch.tensor(row)
        out[name] = values
    with_images = [ex for ex in examples if ex.get("pixel_inputs")]
    if not with_images:
        return out
    kinds = {ex["pixels_by"] for ex in with_images}
    if len(kinds) != 1:  # one model, one family: a mix is a bug
        raise ValueError(f"rows of different VLM families in one micro-batch ({sorted(kinds)})")
    for name in with_images[0]["pixel_inputs"]:
        parts = [ex["pixel_inputs"][name] for ex in with_images]
        if kinds == {"row"}:  # (1, tiles, ...) each: pad the tiles to the most of the batch
            tiles = max(p.shape[1] for p in parts)
            parts = [
                torch.cat([p, p.new_zeros((p.shape[0], tiles - p.shape[1], *p.shape[2:]))], dim=1)
                if p.shape[1] < tiles
                else p
                for p in parts
            ]
        out[name] = torch.cat(parts, dim=0)
    return out
