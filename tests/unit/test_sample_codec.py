"""The sample codec: every supported type round-trips bit-exactly; hostile payloads are refused."""

from __future__ import annotations

import math
import pickle
import struct
from collections import OrderedDict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from cube_torch.samples import codec
from cube_torch.samples.codec import CodecError, decode, encode

NAN_PAYLOAD = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF))[0]
NEG_NAN = struct.unpack("<d", struct.pack("<Q", 0xFFF0_0000_0000_0001))[0]  # signalling, negative


def bits(value: float) -> bytes:
    return struct.pack("<d", value)


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality, type included (NaN payloads and -0.0 compared as bits)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return bits(a) == bits(b)
    if isinstance(a, complex):
        return bits(a.real) == bits(b.real) and bits(a.imag) == bits(b.imag)
    if isinstance(a, (tuple, list)):
        return bool(len(a) == len(b) and all(same(x, y) for x, y in zip(a, b)))
    if isinstance(a, dict):
        return bool(list(a) == list(b) and all(same(a[k], b[k]) for k in a))
    if isinstance(a, np.ndarray):
        return bool(a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, np.generic):
        return bool(a.dtype == b.dtype and a.tobytes() == b.tobytes())
    if isinstance(a, torch.Tensor):
        return bool(a.dtype == b.dtype and a.shape == b.shape
                    and (a.contiguous().reshape(-1).view(torch.uint8).tolist()
                         == b.reshape(-1).view(torch.uint8).tolist())
                    if a.numel() else a.dtype == b.dtype and a.shape == b.shape)
    if isinstance(a, Image.Image):
        return bool(a.mode == b.mode and a.size == b.size and a.tobytes() == b.tobytes()
                    and a.getpalette() == b.getpalette())
    return bool(a == b)


SCALARS: list[Any] = [
    None, True, False, 0, 1, -1, 2**63 - 1, -2**63, 2**63, -2**63 - 1, 2**200, -(3**150), 255, -256,
    0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, NAN_PAYLOAD, NEG_NAN, 5e-324,
    1 + 2j, complex(-0.0, NAN_PAYLOAD),
    "", "héllo ∂ 🐍", "lone \udc80 surrogate", b"", b"\x00\xff" * 10, bytearray(b"abc"),
]


@pytest.mark.parametrize("value", SCALARS, ids=repr)
def test_scalars_round_trip(value: Any) -> None:
    assert same(decode(encode(value)), value)


NUMPY_DTYPES = ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
                "float16", "float32", "float64", "complex64", "complex128", ">i4", ">f8", ">c16"]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (2, 3, 4)])
def test_numpy_arrays_round_trip(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    if np.dtype(dtype).kind == "b":
        raw &= 1
    array = np.frombuffer(raw.tobytes(), dtype=dtype).reshape(shape)  # any bits: NaN payloads too
    out = decode(encode(array))
    assert same(out, array)
    assert out.flags.writeable and out.flags.c_contiguous


def test_numpy_non_contiguous_and_scalars() -> None:
    a = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    for view in (a[:, ::2, 1:], a[::-1], a[:, :, :1].transpose(1, 0, 2)):  # not one dense block
        out = decode(encode(view))
        assert same(out, np.ascontiguousarray(view)) and out.flags.c_contiguous and out.flags.writeable
    for view in (a.transpose(2, 0, 1), a.transpose(1, 2, 0), a.T, a[:1].transpose(2, 1, 0)):  # one, permuted
        out = decode(encode(view))
        assert same(out, np.ascontiguousarray(view)) and out.strides == view.strides and out.flags.writeable
    for scalar in (np.float32(-0.0), np.float64(NAN_PAYLOAD), np.int8(-5), np.uint64(2**64 - 1), np.bool_(True),
                   np.complex64(1 - 1j), np.float16(65504)):
        assert same(decode(encode(scalar)), scalar)


TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (2, 0), (5,), (3, 4, 2)])
def test_tensors_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(2)
    n = int(np.prod(shape)) if shape else 1
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    tensor = raw.view(dtype).reshape(shape)  # any bit patterns (NaN payloads, -0.0)
    out = decode(encode(tensor))
    assert same(out, tensor)
    assert out.is_contiguous() and not out.requires_grad


def test_tensor_views_and_grad() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    for view in (base.transpose(0, 2), base.permute(1, 2, 0), base[:1].transpose(0, 2)):  # permuted dense
        out = decode(encode(view))
        assert same(out, view.contiguous()) and out.stride() == view.stride() and not out.is_contiguous()
    for view in (base[:, ::2, 1:], base.expand(2, 2, 3, 4)[1], base[0, 0, 0], base[:, :, 1:].transpose(0, 2)):
        out = decode(encode(view))
        assert same(out, view.contiguous()) and out.is_contiguous()
    lazy = torch.tensor([1 + 2j, -3j], dtype=torch.complex64).conj()  # a conjugate bit, no copy yet
    assert lazy.is_conj() and same(decode(encode(lazy)), lazy.resolve_conj())
    p = torch.nn.Parameter(torch.tensor([-0.0, 1.0]))
    out = decode(encode(p))
    assert type(out) is torch.Tensor and not out.requires_grad and same(out, p.detach().clone())


def test_a_non_contiguous_value_is_reordered_in_its_one_copy() -> None:
    """encode_parts hands a non-contiguous array or tensor that is not one dense block over
    uncopied; join and write_parts reorder it as they copy it: the bytes are those of its
    contiguous copy's encoding."""
    values: list[Any] = [
        torch.arange(12.0).reshape(3, 4)[:, ::2], torch.tensor([1 + 2j, 3j], dtype=torch.complex128).expand(3, 2),
        torch.tensor([True, False]).expand(2, 2).t(), np.arange(30, dtype=">i4").reshape(5, 6)[::-1, ::2],
        torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(torch.bfloat16)[:, 1:].permute(2, 0, 1),
    ]
    for value in values:
        contiguous = value.contiguous() if isinstance(value, torch.Tensor) else np.ascontiguousarray(value)
        parts = codec.encode_parts([value, 7], b"head")
        assert any(isinstance(part, np.ndarray) for part in parts), value  # nothing copied yet
        want = encode([contiguous, 7], b"head")
        assert bytes(codec.join(parts)) == want
        out = bytearray(codec.size_of(parts))
        codec.write_parts(parts, memoryview(out))
        assert out == want and same(decode(memoryview(out)[4:]), [contiguous, 7])
    with pytest.raises(ValueError, match="parts for a buffer"):
        codec.write_parts(codec.encode_parts(values[0]), memoryview(bytearray(1000)))


def test_a_permuted_dense_value_is_stored_as_its_memory_lies() -> None:
    """torchvision's PILToTensor gives the CHW view of an HWC image: its bytes are stored in
    memory order (a plain copy, no reordering) with the order of its dimensions, and it
    decodes to a tensor of the same strides and values; the same for a transposed numpy
    array and other dtypes."""
    hwc = torch.randint(0, 256, (5, 6, 3), dtype=torch.uint8)
    values: list[Any] = [
        hwc.permute(2, 0, 1),
        torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(torch.bfloat16).permute(2, 0, 1),
        torch.tensor([[True, False, True], [False, False, True]]).t(),
        np.arange(30, dtype=">i4").reshape(5, 6).T,
    ]
    for value in values:
        parts = codec.encode_parts(value, b"head")
        assert not any(isinstance(part, np.ndarray) for part in parts), value  # nothing to reorder
        if isinstance(value, torch.Tensor):
            memory = value.permute(*sorted(range(value.dim()), key=lambda d: -value.stride()[d])).contiguous()
            raw = memory.reshape(-1).view(torch.uint8).numpy().tobytes()
        else:
            raw = value.T.copy().tobytes()
        encoded = bytes(codec.join(parts))
        assert encoded.endswith(raw) and encoded[4:5] in (b"q", b"A")  # the block as it lies
        out = decode(encoded[4:])
        if isinstance(value, torch.Tensor):
            assert same(out, value.contiguous()) and out.stride() == value.stride()
        else:
            assert same(out, np.ascontiguousarray(value)) and out.strides == value.strides
        ring = bytearray(codec.size_of(parts))
        codec.write_parts(parts, memoryview(ring))
        assert ring == encoded
    assert decode(encode(hwc.permute(2, 0, 1)))[0, 1, 2] == hwc[1, 2, 0]


@pytest.mark.parametrize("mode", sorted(codec.PIL_MODES))
def test_pil_images_round_trip(mode: str) -> None:
    rng = np.random.default_rng(3)
    image = Image.new(mode, (13, 7))
    raw = rng.integers(0, 256, size=len(image.tobytes()), dtype=np.uint8).tobytes()
    image = Image.frombytes(mode, (13, 7), raw)
    if mode in ("P", "PA"):
        image.putpalette(rng.integers(0, 256, size=768, dtype=np.uint8).tobytes())
    out = decode(encode(image))
    assert same(out, image)


def test_pil_empty_and_lazy_images(tmp_path: Any) -> None:
    assert same(decode(encode(Image.new("RGB", (0, 5)))), Image.new("RGB", (0, 5)))
    path = tmp_path / "x.png"
    Image.frombytes("RGB", (4, 3), bytes(range(36))).save(path)
    with Image.open(path) as lazy:  # a PngImageFile, not yet loaded
        out = decode(encode(lazy))
        assert out.tobytes() == bytes(range(36)) and type(out) is Image.Image


def test_containers_round_trip() -> None:
    Point = namedtuple("Point", "x y")
    sample = {
        "image": torch.rand(3, 8, 8), "label": 7, "meta": {"path": "a/b.jpg", (1, "k"): [1.5, None]},
        -0.0: b"x", None: (), 3: [], True: {}, b"key": bytearray(b"\0"), np.int64(5): "numpy key",
        "nested": [[[[[(1,)]]]]], "point": Point(1, 2), "ordered": OrderedDict(b=1, a=2),
    }
    out = decode(encode(sample))
    expected = {**sample, "point": (1, 2), "ordered": {"b": 1, "a": 2}}
    assert same(out, expected)
    assert list(out["ordered"]) == ["b", "a"]


def test_decode_does_not_alias_the_buffer() -> None:
    array, tensor, image = np.arange(10, dtype=np.int32), torch.arange(10), Image.new("L", (4, 4), 9)
    ring = bytearray(encode([array, tensor, image, b"bytes"]))
    out = decode(memoryview(ring))
    ring[:] = b"\xff" * len(ring)  # the store reuses its buffer on the next call
    assert same(out, [array, tensor, image, b"bytes"])
    out[0][0] = 99  # and the arrays are the caller's own, writable
    out[1][0] = 99


@pytest.mark.parametrize("value", [object(), {1, 2}, np.array(["a"]), np.array([1], dtype=object),
                                   np.datetime64("2020-01-01"), range(3), len, complex,
                                   torch.tensor([1]).to_sparse(), torch.tensor([1.0], dtype=torch.float8_e4m3fn)],
                         ids=repr)
def test_unsupported_values_are_refused_at_encode(value: Any) -> None:
    with pytest.raises(CodecError):
        encode(value)


def test_cycles_and_depth_are_refused() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(CodecError, match="deeper"):
        encode(loop)
    deep: Any = 0
    for _ in range(codec.MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(CodecError):
        encode(deep)


# -- hostile payloads --------------------------------------------------------------------------


def refused(payload: bytes) -> None:
    with pytest.raises(CodecError):
        decode(payload)


def test_truncated_payloads_are_refused_at_every_length() -> None:
    payload = encode({"a": [torch.rand(2, 3), np.arange(4), Image.new("P", (2, 2)), 2**100, "str", b"b"]})
    for n in range(len(payload)):
        refused(payload[:n])
    refused(payload + b"N")  # trailing garbage


def test_huge_lengths_allocate_nothing() -> None:
    refused(b"s" + struct.pack("<I", 2**32 - 1))
    refused(b"b" + struct.pack("<I", 2**31))
    refused(b"l" + struct.pack("<I", 2**32 - 1) + b"N" * 10)
    refused(b"d" + struct.pack("<I", 2**31) + b"NN")
    refused(b"a\x03<f4\x01" + struct.pack("<QQ", 2**62, 2**64 - 1))  # shape x itemsize != stated bytes
    refused(b"a\x03<f4\x02" + struct.pack("<QQQ", 2**40, 2**40, 0))  # claims 4 PiB, has none
    refused(b"p\x08\x01" + struct.pack("<QQ", 2**61, 2**63))
    refused(b"q\x08\x02" + struct.pack("<QQ", 2**40, 2**40) + b"\x01\x00" + struct.pack("<Q", 0))
    refused(b"A\x03<f4\x02" + struct.pack("<QQ", 2**40, 2**40) + b"\x01\x00" + struct.pack("<Q", 2**64 - 1))
    refused(b"m\x03RGB" + struct.pack("<II", 2**31, 2**31) + struct.pack("<Q", 0) + b"\0" + struct.pack("<I", 0))
    refused(b"m\x03RGB" + struct.pack("<II", 2, 2) + struct.pack("<Q", 3) + b"abc\0" + struct.pack("<I", 0))


def test_deep_nesting_is_refused() -> None:
    refused(b"l\x01\x00\x00\x00" * 100_000 + b"N")
    refused(b"t\x01\x00\x00\x00" * (codec.MAX_DEPTH + 2) + b"N")


@pytest.mark.parametrize("payload", [
    b"", b"Z", b"\x80", b"o", b"x\x03<M8" + b"\0" * 8,  # unknown tags; datetime dtype
    b"a\x03|O8\x01" + struct.pack("<QQ", 1, 8) + b"\0" * 8,  # object dtype: pointers
    b"a\x04<U10\x01" + struct.pack("<QQ", 1, 40) + b"\0" * 40,
    b"a\x05float\x01" + struct.pack("<QQ", 1, 4) + b"\0" * 4,
    b"a\x03|b1\x01" + struct.pack("<QQ", 1, 1) + b"\x02",  # a bool that is neither 0 nor 1
    b"p\xfe\x00" + struct.pack("<Q", 1) + b"\0",  # unknown torch dtype code
    b"a\x03<f4" + bytes([codec.MAX_NDIM + 1]),
    b"q\x01\x02" + struct.pack("<QQ", 1, 2) + b"\x00\x00" + struct.pack("<Q", 2) + b"ab",  # no permutation
    b"q\x01\x02" + struct.pack("<QQ", 1, 2) + b"\x02\x00" + struct.pack("<Q", 2) + b"ab",  # a dimension too far
    b"A\x03|b1\x02" + struct.pack("<QQ", 1, 2) + b"\x01\x00" + struct.pack("<Q", 2) + b"\x01\x07",  # bad bool
    b"m\x04RGBZ" + struct.pack("<IIQ", 1, 1, 3) + b"abc\0" + struct.pack("<I", 0),  # mode not allowed
    b"m\x01P" + struct.pack("<IIQ", 1, 1, 1) + b"a\x03BGR" + struct.pack("<I", 3) + b"abc",  # palette mode
    b"s\x01\x00\x00\x00\xff",  # not UTF-8
    b"d\x01\x00\x00\x00l\x00\x00\x00\x00N",  # an unhashable key
], ids=repr)
def test_malformed_payloads_are_refused(payload: bytes) -> None:
    refused(payload)


class Boom:
    def __reduce__(self) -> Any:
        return (exec, ("import os; os.environ['CODEC_PWNED'] = '1'",))


def test_a_pickle_is_never_unpickled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CODEC_PWNED", raising=False)
    evil = pickle.dumps(Boom(), protocol=0)
    for payload in (evil, pickle.dumps(Boom(), protocol=5), b"b" + struct.pack("<I", len(evil)) + evil[:-1]):
        try:
            decode(payload)
        except CodecError:
            pass
    wrapped = b"b" + struct.pack("<I", len(evil)) + evil  # a pickle inside bytes stays bytes
    assert decode(wrapped) == evil
    assert "CODEC_PWNED" not in __import__("os").environ
    with pytest.raises(CodecError):
        encode(Boom())


def test_the_codec_has_no_way_to_run_code() -> None:
    """The codec imports no pickle, marshal or importlib and calls no eval, exec or __import__."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(codec))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names} | {node.module.split(".")[0] for node in ast.walk(tree)
                                            if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "functools", "struct", "sys", "typing", "numpy", "torch", "PIL"}, imported
    called = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert not called & {"eval", "exec", "compile", "__import__", "globals", "vars"}, called
    for node in ast.walk(tree):  # attributes looked up by name: only by names written in the codec
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            assert isinstance(node.args[1], ast.Constant), ast.unparse(node)
