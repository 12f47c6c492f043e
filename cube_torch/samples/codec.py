"""The sample codec: what a dataset returns, as bytes and back, without pickle, because a
store that other ranks, jobs or Redis users can write must never lead to code execution in
the trainer. It covers a closed set of types, round-tripping bit-exactly: ``None``,
``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``bytearray``; ``tuple``,
``list``, ``dict`` up to :data:`MAX_DEPTH` levels (subclasses decode as the base type);
numpy arrays and scalars of :data:`NUMPY_DTYPES`, CPU torch tensors of :data:`TORCH_DTYPES`
(no autograd state) and PIL images of :data:`PIL_MODES` (no ``info``). A dense array in a
permuted order (``PILToTensor``'s CHW view) is stored as its memory lies and decoded with
the same strides; every decoded array has memory of its own, never aliasing the buffer
(which may be a store's reused ring). Anything else raises :class:`CodecError` at encode
time; a malformed, truncated or oversized payload raises it at decode time before more than
the payload's own size is allocated. The format is in docs/on-disk.md, "What a sample entry
holds"."""

from __future__ import annotations

import functools
import struct
import sys
from typing import Any

import numpy as np

# Nesting deeper than this is refused both ways (a cycle on encode, a hostile payload that
# would exhaust the stack on decode); real samples nest 2-4 levels.
MAX_DEPTH = 32
# Array and tensor dimensions: numpy itself allows 64; no sample has more than a handful.
MAX_NDIM = 32
# A PIL image side: PIL's own decompression-bomb guard warns at ~89 Mpixels; no sample is
# wider or higher than this.
MAX_IMAGE_SIDE = 1 << 20

# numpy dtypes (as dtype.str): numbers and booleans in either byte order; no object,
# string, datetime or structured dtype (nothing whose decoding could run code or whose
# size is not fixed by the shape).
NUMPY_DTYPES = frozenset(
    ["|b1", "|u1", "|i1"]
    + [f"{order}{kind}{size}" for order in "<>" for kind in "ui" for size in (2, 4, 8)]
    + [f"{order}f{size}" for order in "<>" for size in (2, 4, 8)]
    + [f"{order}c{size}" for order in "<>" for size in (8, 16)])
# Supported PIL image modes (those whose pixels ``tobytes``/``frombytes`` carry fully).
PIL_MODES = frozenset(["1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr",
                       "LAB", "HSV", "I", "F", "I;16", "I;16L", "I;16B", "I;16N"])
PALETTE_MODES = frozenset(["RGB", "RGBA"])

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_C128 = struct.Struct("<dd")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_U32_MAX = (1 << 32) - 1


class CodecError(ValueError):
    """A value the codec does not support (encode) or a payload it refuses (decode)."""


def _torch_dtypes() -> list[Any]:
    """Torch dtypes by wire code (index); an append-only list: codes never change meaning."""
    import torch

    return [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
            torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
            getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None)]


_torch_codes: dict[Any, int] | None = None


def _torch_code(dtype: Any) -> int:
    global _torch_codes
    if _torch_codes is None:
        _torch_codes = {d: code for code, d in enumerate(_torch_dtypes()) if d is not None}
    code = _torch_codes.get(dtype)
    if code is None:
        raise CodecError(f"cannot encode a torch tensor of dtype {dtype} (supported: bool, integers, float16, "
                         "bfloat16, float32, float64, complex64, complex128)")
    return code


TORCH_DTYPES = "bool, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64, complex64, complex128, uint16/32/64"


# -- encode ------------------------------------------------------------------------------------


# A part of an encoding: bytes, a byte view (format "B") of a contiguous array, or a
# non-contiguous numpy array (a view of the value's own memory), written in C order.
Part = bytes | bytearray | memoryview | np.ndarray  # (see encode_parts)


def encode(obj: Any, prefix: bytes = b"") -> bytes:
    """The bytes of ``obj`` (see the module docstring for what is supported), after
    ``prefix`` (a header of the caller's)."""
    return bytes(join(encode_parts(obj, prefix)))


def encode_parts(obj: Any, prefix: bytes = b"") -> list[Part]:
    """What ``encode`` joins, in order: byte strings, and views *of obj's own arrays and
    tensors* (no copy), valid while ``obj`` is not changed; the caller copies them out at
    once (:func:`join`, or :func:`write_parts` into a store's buffer): one copy of each
    array's bytes, a non-contiguous one (torchvision's ``PILToTensor`` gives the CHW view of
    an HWC image) reordered in that same copy."""
    parts: list[Part] = [prefix]
    _encode(obj, parts, 0)
    return parts


def size_of(parts: list[Part]) -> int:
    return sum(part.nbytes if isinstance(part, (memoryview, np.ndarray)) else len(part) for part in parts)


def join(parts: list[Part]) -> bytes | bytearray:
    """The parts as one buffer: one copy of every byte."""
    if not any(isinstance(part, np.ndarray) for part in parts):
        return b"".join(parts)  # type: ignore[arg-type]  # (only bytes and byte views)
    out = bytearray(size_of(parts))
    with memoryview(out) as view:
        write_parts(parts, view)
    return out


def write_parts(parts: list[Part], out: memoryview) -> None:
    """Copy the parts into ``out`` (a writable byte view of exactly their size), each
    non-contiguous array reordered to C order as it is copied."""
    position = 0
    for part in parts:
        if isinstance(part, np.ndarray):
            n = part.nbytes
            np.copyto(np.frombuffer(out[position:position + n], dtype=part.dtype).reshape(part.shape), part)
        else:
            n = part.nbytes if isinstance(part, memoryview) else len(part)
            out[position:position + n] = part
        position += n
    if position != len(out):
        raise ValueError(f"{position} bytes of parts for a buffer of {len(out)}")


def _length(n: int, what: str) -> bytes:
    if n > _U32_MAX:
        raise CodecError(f"{what} of {n} items or bytes is too large to encode (at most {_U32_MAX})")
    return _U32.pack(n)


def _encode(obj: Any, out: list[Part], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise CodecError(f"the sample nests deeper than {MAX_DEPTH} levels (or contains a cycle)")
    kind = type(obj)
    if obj is None:
        out.append(b"N")
    elif kind is bool or isinstance(obj, bool):
        out.append(b"T" if obj else b"F")
    elif isinstance(obj, np.generic):
        _encode_numpy_scalar(obj, out)
    elif isinstance(obj, int):
        value = int(obj)
        if _INT64_MIN <= value <= _INT64_MAX:
            out += (b"i", _I64.pack(value))
        else:
            data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            out += (b"I", _length(len(data), "an int"), data)
    elif isinstance(obj, float):
        out += (b"f", _F64.pack(obj))
    elif isinstance(obj, complex):
        out += (b"c", _C128.pack(obj.real, obj.imag))
    elif isinstance(obj, str):
        data = obj.encode("utf-8", "surrogatepass")
        out += (b"s", _length(len(data), "a str"), data)
    elif isinstance(obj, bytes):
        out += (b"b", _length(len(obj), "a bytes"), bytes(obj))
    elif isinstance(obj, bytearray):
        out += (b"B", _length(len(obj), "a bytearray"), bytes(obj))
    elif isinstance(obj, (tuple, list)):
        out += (b"t" if isinstance(obj, tuple) else b"l", _length(len(obj), "a sequence"))
        for item in obj:
            _encode(item, out, depth + 1)
    elif isinstance(obj, dict):
        out += (b"d", _length(len(obj), "a dict"))
        for key, value in obj.items():
            _encode(key, out, depth + 1)
            _encode(value, out, depth + 1)
    elif isinstance(obj, np.ndarray):
        _encode_array(obj, out)
    elif _is_tensor(obj):
        _encode_tensor(obj, out)
    elif _is_image(obj):
        _encode_image(obj, out)
    else:
        raise CodecError(f"cannot encode a {kind.__module__}.{kind.__qualname__} (supported: None, bool, int, "
                         "float, complex, str, bytes, tuple, list, dict, numpy arrays and scalars, torch "
                         "tensors, PIL images)")


def _dtype_str(dtype: np.dtype[Any]) -> bytes:
    name = dtype.str
    if name not in NUMPY_DTYPES:
        raise CodecError(f"cannot encode a numpy value of dtype {dtype} (supported: bool, integers, float16/32/64, "
                         "complex64/128)")
    return name.encode("ascii")


def _encode_numpy_scalar(obj: np.generic, out: list[Part]) -> None:
    name = _dtype_str(obj.dtype)
    out += (b"x", _U8.pack(len(name)), name, obj.tobytes())


def _shape(shape: tuple[int, ...]) -> bytes:
    if len(shape) > MAX_NDIM:
        raise CodecError(f"cannot encode an array of {len(shape)} dimensions (at most {MAX_NDIM})")
    return _U8.pack(len(shape)) + b"".join(_U64.pack(n) for n in shape)


def _encode_array(obj: np.ndarray[Any, Any], out: list[Part]) -> None:
    name = _dtype_str(obj.dtype)
    data, order = _layout(obj)
    if order is None:
        out += (b"a", _U8.pack(len(name)), name, _shape(obj.shape), _U64.pack(obj.nbytes), data)
    else:
        out += (b"A", _U8.pack(len(name)), name, _shape(obj.shape), bytes(order), _U64.pack(obj.nbytes), data)


def _layout(array: np.ndarray[Any, Any]) -> tuple[Part, list[int] | None]:
    """An array's bytes, uncopied, and their order of dimensions (see Layout): a byte view
    of its memory when that is one dense block, in C order (None) or in another (the
    order); else the array itself, reordered to C order as the caller copies it (one copy
    either way)."""
    if array.flags.c_contiguous:
        return _bytes_view(array.reshape(-1)), None
    order = _memory_order(array.strides)
    if order is not None:
        dense = array.transpose(order)
        if dense.flags.c_contiguous:
            return _bytes_view(dense.reshape(-1)), order
    return array, None


def _memory_order(strides: tuple[int, ...]) -> list[int] | None:
    """The dimensions by decreasing stride (ties in their own order): the order in which a
    value whose memory is one dense block lays them out (the caller checks that it is);
    None for C order itself (no reordering to record)."""
    order = sorted(range(len(strides)), key=lambda d: -strides[d])
    return None if order == list(range(len(strides))) else order


def _bytes_view(array: Any) -> memoryview:
    """A byte view of a contiguous 1-D array (no copy: the join in encode is the one copy)."""
    return memoryview(array).cast("B")


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # never imported here for a sample that is no tensor
    return torch is not None and isinstance(obj, torch.Tensor)


def _encode_tensor(obj: Any, out: list[Part]) -> None:
    code = _torch_code(obj.dtype)
    if obj.device.type != "cpu":
        raise CodecError(f"cannot encode a tensor on {obj.device} (cache CPU tensors: move them in the transform "
                         "that runs after the cache)")
    if obj.layout is not _torch_strided():
        raise CodecError(f"cannot encode a {obj.layout} tensor (only dense, strided ones)")
    if obj.requires_grad:
        obj = obj.detach()
    if obj.is_conj() or obj.is_neg():  # a lazy conjugate or negative view: its values made real
        obj = obj.resolve_conj().resolve_neg()
    # Its memory as a numpy array of the same strides (no copy; numpy calls are a fraction of
    # torch's view ops, which cost 1-5 us each in a decoding worker): the tensor's own dtype,
    # or integers of its item size for one numpy lacks (bfloat16).
    try:
        array = obj.numpy()
    except (TypeError, RuntimeError):
        array = obj.view(_same_size_int(obj.element_size())).numpy()
    data, order = _layout(array)
    shape, nbytes = _shape(tuple(obj.shape)), _U64.pack(array.nbytes)
    if order is None:
        out += (b"p", _U8.pack(code), shape, nbytes, data)
    else:
        out += (b"q", _U8.pack(code), shape, bytes(order), nbytes, data)


def _same_size_int(itemsize: int) -> Any:
    torch = _torch()
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]


def _torch() -> Any:
    return sys.modules["torch"]  # (only called for a value that is a tensor: torch is imported)


@functools.cache
def _torch_strided() -> Any:
    return _torch().strided


def _is_image(obj: Any) -> bool:
    image = sys.modules.get("PIL.Image")
    return image is not None and isinstance(obj, image.Image)


def _encode_image(obj: Any, out: list[Part]) -> None:
    mode = obj.mode
    if mode not in PIL_MODES:
        raise CodecError(f"cannot encode a PIL image of mode {mode!r} (supported: {', '.join(sorted(PIL_MODES))})")
    pixels = obj.tobytes()
    name = mode.encode("ascii")
    out += (b"m", _U8.pack(len(name)), name, _U32.pack(obj.width), _U32.pack(obj.height),
            _U64.pack(len(pixels)), pixels)
    palette_mode, palette = b"", b""
    if mode in ("P", "PA") and obj.palette is not None:
        palette_mode = obj.palette.mode.encode("ascii")
        if obj.palette.mode not in PALETTE_MODES:
            raise CodecError(f"cannot encode a palette of mode {obj.palette.mode!r}")
        palette = bytes(obj.getpalette(obj.palette.mode) or b"")
    out += (_U8.pack(len(palette_mode)), palette_mode, _U32.pack(len(palette)), palette)


# -- decode ------------------------------------------------------------------------------------


class _Reader:
    __slots__ = ("view", "pos")

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.pos = 0

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.view):
            raise CodecError(f"truncated payload: {n} bytes wanted at offset {self.pos} of {len(self.view)}")
        chunk = self.view[self.pos:end]
        self.pos = end
        return chunk

    def unpack(self, fmt: struct.Struct) -> Any:
        return fmt.unpack(self.take(fmt.size))[0]

    def count(self, minimum_item_bytes: int) -> int:
        """A u32 count of items that each take at least ``minimum_item_bytes`` of what is left."""
        n = int(self.unpack(_U32))
        if n * minimum_item_bytes > len(self.view) - self.pos:
            raise CodecError(f"a count of {n} items does not fit in the {len(self.view) - self.pos} bytes left")
        return n


def decode(buffer: bytes | bytearray | memoryview) -> Any:
    """The value encoded in ``buffer`` (its arrays and tensors own their memory)."""
    view = memoryview(buffer)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    reader = _Reader(view)
    value = _decode(reader, 0)
    if reader.pos != len(view):
        raise CodecError(f"{len(view) - reader.pos} bytes of garbage after the value")
    return value


def _decode(r: _Reader, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise CodecError(f"the payload nests deeper than {MAX_DEPTH} levels")
    tag = bytes(r.take(1))
    if tag == b"N":
        return None
    if tag == b"T":
        return True
    if tag == b"F":
        return False
    if tag == b"i":
        return int(r.unpack(_I64))
    if tag == b"I":
        n = int(r.unpack(_U32))
        return int.from_bytes(r.take(n), "little", signed=True)
    if tag == b"f":
        return float(r.unpack(_F64))
    if tag == b"c":
        real, imag = _C128.unpack(r.take(_C128.size))
        return complex(real, imag)
    if tag == b"s":
        n = int(r.unpack(_U32))
        try:
            return str(r.take(n), "utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise CodecError(f"a str that is not UTF-8: {exc}") from None
    if tag == b"b":
        return bytes(r.take(int(r.unpack(_U32))))
    if tag == b"B":
        return bytearray(r.take(int(r.unpack(_U32))))
    if tag in (b"t", b"l"):
        n = r.count(1)
        items = [_decode(r, depth + 1) for _ in range(n)]
        return tuple(items) if tag == b"t" else items
    if tag == b"d":
        n = r.count(2)
        result: dict[Any, Any] = {}
        for _ in range(n):
            key = _decode(r, depth + 1)
            try:
                hash(key)
            except TypeError:
                raise CodecError(f"a dict key of type {type(key).__name__} (not hashable)") from None
            result[key] = _decode(r, depth + 1)
        return result
    if tag == b"a":
        return _decode_array(r, ordered=False)
    if tag == b"A":
        return _decode_array(r, ordered=True)
    if tag == b"x":
        dtype = _read_dtype(r)
        data = r.take(dtype.itemsize)
        if dtype.kind == "b":
            _check_booleans(data)
        return np.frombuffer(data, dtype=dtype)[0]  # a numpy scalar holds its own copy
    if tag == b"p":
        return _decode_tensor(r, ordered=False)
    if tag == b"q":
        return _decode_tensor(r, ordered=True)
    if tag == b"m":
        return _decode_image(r)
    raise CodecError(f"unknown tag {tag!r} at offset {r.pos - 1}")


def _read_dtype(r: _Reader) -> np.dtype[Any]:
    n = int(r.unpack(_U8))
    name = bytes(r.take(n)).decode("ascii", "replace")
    if name not in NUMPY_DTYPES:
        raise CodecError(f"dtype {name!r} is not allowed")
    return np.dtype(name)


def _read_shape(r: _Reader) -> tuple[int, ...]:
    ndim = int(r.unpack(_U8))
    if ndim > MAX_NDIM:
        raise CodecError(f"{ndim} dimensions (at most {MAX_NDIM})")
    return tuple(int(r.unpack(_U64)) for _ in range(ndim))


def _elements(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n  # Python ints: no overflow; checked against the bytes present below
    return count


def _read_data(r: _Reader, shape: tuple[int, ...], itemsize: int) -> memoryview:
    n = int(r.unpack(_U64))
    if n != _elements(shape) * itemsize:
        raise CodecError(f"{n} data bytes for shape {shape} of {itemsize}-byte items")
    return r.take(n)


def _read_order(r: _Reader, ndim: int) -> tuple[int, ...]:
    """A layout's order of dimensions (see Layout): a permutation of range(ndim)."""
    order = tuple(r.take(ndim))
    if sorted(order) != list(range(ndim)):
        raise CodecError(f"a dimension order {order} that is no permutation of {ndim} dimensions")
    return order


def _read_layout(r: _Reader, ordered: bool) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(the shape of the stored C-order block, the permutation that gives the value's
    dimensions from it, or None for C order)."""
    shape = _read_shape(r)
    if not ordered:
        return shape, None
    order = _read_order(r, len(shape))
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return tuple(shape[d] for d in order), tuple(inverse)


def _decode_array(r: _Reader, *, ordered: bool) -> np.ndarray[Any, Any]:
    dtype = _read_dtype(r)
    block, inverse = _read_layout(r, ordered)
    data = _read_data(r, block, dtype.itemsize)
    if dtype.kind == "b":
        _check_booleans(data)
    array = np.frombuffer(data, dtype=dtype).reshape(block).copy()  # the one copy: its own memory
    return array if inverse is None else array.transpose(inverse)


def _check_booleans(data: memoryview) -> None:
    """Booleans are stored as bytes 0 and 1; any other byte is a forged payload."""
    if len(data) and int(np.frombuffer(data, dtype=np.uint8).max()) > 1:
        raise CodecError("a boolean array holding bytes other than 0 and 1")


def _decode_tensor(r: _Reader, *, ordered: bool) -> Any:
    import torch

    code = int(r.unpack(_U8))
    dtypes = _torch_dtypes()
    dtype = dtypes[code] if code < len(dtypes) else None
    if dtype is None:
        raise CodecError(f"torch dtype code {code} is not allowed")
    block, inverse = _read_layout(r, ordered)
    data = _read_data(r, block, dtype.itemsize)
    if dtype == torch.bool:
        _check_booleans(data)
    if not len(data):
        tensor = torch.empty(block, dtype=dtype)
    else:
        raw = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())  # the one copy; aligned (malloc)
        tensor = raw.view(dtype).reshape(block)
    return tensor if inverse is None else tensor.permute(inverse)


def _decode_image(r: _Reader) -> Any:
    from PIL import Image

    mode = bytes(r.take(int(r.unpack(_U8)))).decode("ascii", "replace")
    if mode not in PIL_MODES:
        raise CodecError(f"PIL mode {mode!r} is not allowed")
    width, height = int(r.unpack(_U32)), int(r.unpack(_U32))
    if width > MAX_IMAGE_SIDE or height > MAX_IMAGE_SIDE:
        raise CodecError(f"an image of {width}x{height} pixels (at most {MAX_IMAGE_SIDE} a side)")
    pixels = r.take(int(r.unpack(_U64)))
    palette_mode = bytes(r.take(int(r.unpack(_U8)))).decode("ascii", "replace")
    palette = r.take(int(r.unpack(_U32)))
    if palette_mode and palette_mode not in PALETTE_MODES:
        raise CodecError(f"palette mode {palette_mode!r} is not allowed")
    if width * height and len(pixels) != _image_bytes(mode, width, height):
        raise CodecError(f"{len(pixels)} pixel bytes for a {mode} image of {width}x{height}")
    try:
        image = Image.frombytes(mode, (width, height), bytes(pixels)) if width * height else Image.new(mode, (width, height))
        if palette_mode:
            image.putpalette(bytes(palette), palette_mode)
    except (ValueError, OSError, SyntaxError) as exc:
        raise CodecError(f"a malformed {mode} image: {exc}") from None
    return image


def _image_bytes(mode: str, width: int, height: int) -> int:
    """What ``tobytes()`` of a ``mode`` image of this size returns, in bytes (rows padded as PIL does)."""
    if mode == "1":
        return (width + 7) // 8 * height  # one bit per pixel, each row padded to a byte
    return _pixel_bytes(mode) * width * height


@functools.cache
def _pixel_bytes(mode: str) -> int:
    from PIL import Image

    return len(Image.new(mode, (1, 1)).tobytes())
