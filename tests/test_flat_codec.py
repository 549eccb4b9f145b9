"""The flat snapshot codec: bit-exact round trips, Megatron leaves, errors naming the key path, zero copy."""

from __future__ import annotations

import argparse
import collections
import contextlib
import enum
import io
import json
import math
import pathlib
import random
import signal
import struct
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tiered_ckpt.codecs.flat import (
    ALIGNMENT,
    FORMAT_VERSION,
    INLINE_BYTES_MAX,
    PLACEMENT_MODULUS,
    EnumStandIn,
    SnapshotPlan,
    TensorEntry,
    copy_into,
    decode_header,
    encode_header,
    plan_snapshot,
    restore,
)
from tiered_ckpt.errors import DecodeError, EncodeError


class ModelType(enum.Enum):  # like megatron.core.enums.ModelType
    encoder_or_decoder = 1
    encoder_and_decoder = 2


class Perm(enum.IntFlag):
    R = 4
    W = 2


# ------------------------------------------------------------------------------------------------ helpers


def roundtrip(items, *, copy=False, map_location=None, buf_extra=0):
    plan = plan_snapshot(items)
    buf = torch.empty(plan.total_bytes + buf_extra, dtype=torch.uint8).fill_(0xA5)
    copy_into(plan, buf)
    header = encode_header(plan)
    info = decode_header(header)
    return restore(info, buf, copy=copy, map_location=map_location), plan, buf, header


def float_bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def tensor_bytes(t: torch.Tensor) -> bytes:
    if not t.numel():
        return b""
    t = t.detach()
    if t.dtype.itemsize == 1:  # sub-byte and float8 dtypes may lack a copy kernel
        t = t.view(torch.uint8)
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t)  # canonical strides, even on size-1 dims
    return dense.reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(a, b, memo=None, path="items"):
    """Bit-exact structural equality: same container types, same float bits, same tensor bytes/dtype/shape,
    and tensor identity: one source object always maps to one restored object."""
    memo = {} if memo is None else memo
    ta = type(a)
    if isinstance(a, tuple) and hasattr(ta, "_fields"):
        ta = tuple  # namedtuples come back as plain tuples (documented)
    if ta is collections.defaultdict:
        ta = dict
    assert type(b) is ta, f"{path}: type {type(b).__name__} != {ta.__name__}"
    if isinstance(a, torch.Tensor):
        assert b.dtype == a.dtype and b.shape == a.shape, (
            f"{path}: {b.dtype}{tuple(b.shape)} != {a.dtype}{a.shape}"
        )
        assert b.requires_grad == a.requires_grad, path
        assert b.is_contiguous(), path
        assert tensor_bytes(b) == tensor_bytes(a), f"{path}: tensor bytes differ"
        if id(a) in memo:
            assert memo[id(a)] is b, f"{path}: a tensor saved once must be restored as one object"
        memo[id(a)] = b
    elif isinstance(a, np.ndarray):
        assert b.dtype == a.dtype and b.dtype.str == a.dtype.str and b.shape == a.shape, path
        assert b.tobytes() == a.tobytes(), f"{path}: array bytes differ"
        if id(a) in memo:
            assert memo[id(a)] is b, path
        memo[id(a)] = b
    elif isinstance(a, np.generic):
        assert b.dtype.str == a.dtype.str and b.tobytes() == a.tobytes(), path
    elif ta is float:
        assert float_bits(b) == float_bits(a), f"{path}: {b!r} != {a!r} (bits)"
    elif ta is complex:
        assert (float_bits(b.real), float_bits(b.imag)) == (float_bits(a.real), float_bits(a.imag)), path
    elif ta in (dict, collections.OrderedDict):
        assert len(a) == len(b), path
        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
            assert_same(ka, kb, memo, f"{path}<key {ka!r}>")
            assert_same(va, vb, memo, f"{path}[{ka!r}]")
    elif ta in (list, tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, memo, f"{path}[{i}]")
    elif ta is argparse.Namespace:
        assert_same(vars(a), vars(b), memo, path)
    elif ta is io.BytesIO:
        assert b.getvalue() == a.getvalue() and b.tell() == 0, path
    elif isinstance(a, enum.Enum):
        assert b is a, path
    else:
        assert b == a, f"{path}: {b!r} != {a!r}"


# ------------------------------------------------------------------------------------------- strategies

TORCH_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]
TORCH_DTYPES += [
    getattr(torch, n)
    for n in (
        "uint16",
        "uint32",
        "uint64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, n)
]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    nbytes = math.prod(shape) * dtype.itemsize
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1
    t = raw.view(dtype).reshape(shape)  # random bits: NaN payloads, subnormals, -0.0, ...
    how = draw(
        st.sampled_from(["plain", "transpose", "stride", "expand", "slice", "parameter", "grad", "conj"])
    )
    if how == "transpose" and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif how == "stride" and t.dim() >= 1:
        t = t[::2]
    elif how == "expand":
        t = t.unsqueeze(0).expand(2, *shape)
    elif how == "slice" and t.dim() >= 1 and shape[0] > 1:
        t = t[1:]
    elif how == "parameter":
        grad = dtype.is_floating_point and dtype.itemsize > 1 and draw(st.booleans())
        t = torch.nn.Parameter(t.clone(), requires_grad=grad)
    elif how == "grad" and dtype in (torch.float32, torch.float64):
        t = t.clone().requires_grad_(True)
    elif how == "conj" and dtype.is_complex:
        t = t.conj()  # a lazy view: copy_ materializes it
    return t


NP_DTYPES = ["<f4", ">f8", "<f2", "<i8", ">i2", "u1", "<u4", "?", "<c16", "<M8[ns]", "<m8[s]", "<U3", "S2"]


@st.composite
def arrays(draw):
    dt = np.dtype(draw(st.sampled_from(NP_DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
    a = draw(hnp.arrays(dt, shape))
    how = draw(st.sampled_from(["plain", "reverse", "transpose", "readonly"]))
    if how == "reverse" and a.ndim >= 1:
        a = a[::-1]
    elif how == "transpose":
        a = a.T
    elif how == "readonly":
        a.flags.writeable = False
    return a


np_scalars = arrays().map(lambda a: a.reshape(-1)[0] if a.size else np.zeros((), a.dtype)[()])
NANS = [struct.unpack("<d", struct.pack("<Q", bits))[0] for bits in (0x7FF0000000000001, 0xFFF8000000000123)]
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [-0.0, 0.0, math.inf, -math.inf, *NANS]
)
ints = st.integers() | st.integers(-(2**300), 2**300) | st.sampled_from([2**53, 2**63, -(2**64) - 1])
blobs = st.binary(max_size=40) | st.builds(
    lambda n, b: bytes([b]) * n,
    st.integers(INLINE_BYTES_MAX - 2, INLINE_BYTES_MAX + 300),
    st.integers(0, 255),
)
scalars = (
    st.none()
    | st.booleans()
    | ints
    | floats
    | st.text(max_size=12)
    | blobs
    | st.complex_numbers(allow_nan=True, allow_infinity=True)
    | blobs.map(bytearray)
    | blobs.map(io.BytesIO)
    | st.sampled_from(
        [
            torch.float32,
            torch.bfloat16,
            torch.Size([2, 0, 3]),
            torch.device("cpu"),
            np.dtype("float32"),
            np.dtype(">i2"),
            signal.SIGTERM,
            ModelType.encoder_and_decoder,
            Perm.R | Perm.W,
            pathlib.PurePosixPath("/a/b"),
            pathlib.PureWindowsPath("c:/x"),
        ]
    )
)
keys = st.recursive(
    st.text(max_size=6)
    | st.integers()
    | st.booleans()
    | st.none()
    | st.floats(allow_nan=False)
    | st.sampled_from([torch.float32, torch.bfloat16, ModelType.encoder_or_decoder]),
    lambda k: st.tuples(k, k) | st.frozensets(st.integers(0, 9), max_size=3),
    max_leaves=3,
)
leaves = scalars | tensors() | arrays() | np_scalars


def containers(children):
    return (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(keys, children, max_size=4)
        | st.dictionaries(st.text(max_size=5), children, max_size=4)
        | st.dictionaries(st.text(max_size=5), children, max_size=3).map(collections.OrderedDict)
        | st.dictionaries(st.from_regex(r"[a-z_]{1,6}", fullmatch=True), children, max_size=3).map(
            lambda d: argparse.Namespace(**d)
        )
        | st.sets(st.integers(-5, 5) | st.text(max_size=3), max_size=3)
        | st.frozensets(st.integers(0, 5), max_size=3)
    )


structures = st.recursive(leaves, containers, max_leaves=12)
SETTINGS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


# ----------------------------------------------------------------------------------------- property tests


@SETTINGS
@given(structures, st.booleans())
def test_roundtrip_is_bit_exact(items, copy):
    out, plan, buf, header = roundtrip({"state": items}, copy=copy)
    assert_same({"state": items}, out)
    assert plan.total_bytes % ALIGNMENT == 0
    assert all(e.offset % ALIGNMENT == 0 and e.offset + e.nbytes <= plan.total_bytes for e in plan.tensors)
    assert len(plan.sources) == len(plan.tensors)
    json.loads(header.decode("ascii"), parse_int=json_safe_int)  # pure ASCII JSON, every number JSON-safe


def json_safe_int(text: str) -> int:
    value = int(text)
    assert abs(value) <= 2**53 - 1, f"integer {text} is not exact in JSON readers that use doubles"
    return value


@settings(max_examples=40, deadline=None)
@given(st.lists(tensors(), min_size=1, max_size=6))
def test_slots_do_not_overlap_and_padding_is_untouched(ts):
    plan = plan_snapshot(ts)
    buf = torch.full((plan.total_bytes,), 0xA5, dtype=torch.uint8)
    copy_into(plan, buf)
    used = torch.zeros(plan.total_bytes, dtype=torch.bool)
    for e in plan.tensors:
        assert not used[e.offset : e.offset + e.nbytes].any()
        used[e.offset : e.offset + e.nbytes] = True
    assert bool((buf[~used] == 0xA5).all()), "copy_into wrote outside the slots"


# ---------------------------------------------------------------------------------------- Megatron items


def megatron_like():
    w = torch.randn(8, 4)
    args = argparse.Namespace(
        lr=3e-4,
        micro_batch_size=2,
        seq_length=2048,
        fp16=False,
        bf16=True,
        params_dtype=torch.bfloat16,
        data_path=["/data/a", "/data/b"],
        ckpt_format="torch",
    )
    return {
        "model_optim_rng": {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": 1200,
            "model_type": ModelType.encoder_or_decoder,
            "model": {
                "embedding.word_embeddings.weight": w,
                "output_layer.weight": w,  # tied embeddings
                "decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(12, 4).bfloat16(),
                "decoder.layers.0.self_attention.linear_qkv._extra_state": io.BytesIO(b"\x80\x04te-fp8-meta"),
                "decoder.layers.0.mlp._extra_state": io.BytesIO(bytes(range(256)) * 40),  # in the buffer
                "decoder.final_layernorm.weight": torch.nn.Parameter(torch.ones(4)),
            },
            "optimizer": {
                "optimizer": {
                    "state": {0: {"exp_avg": torch.zeros(8, 4), "step": torch.tensor(12.0)}},
                    "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "params": [0]}],
                },
                "fp32_from_fp16_params": [[torch.randn(8, 4)]],
            },
            "opt_param_scheduler": {"max_lr": 3e-4, "decay_style": "cosine", "num_steps": 2400},
            "rng_state": [
                {
                    "random_rng_state": random.getstate(),
                    "np_rng_state": np.random.get_state(),
                    "torch_rng_state": torch.get_rng_state(),
                    "cuda_rng_state": torch.get_rng_state(),
                    "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()},
                }
            ],
            "num_floating_point_operations_so_far": 2**70,
            "signal": signal.SIGTERM,
        },
        "distrib_optim": {
            "param_state_sharding_type": "dp_reshardable",
            0: {
                (torch.float32, torch.float32): {
                    "param": torch.randn(32),
                    "exp_avg": torch.randn(32),
                    "exp_avg_sq": torch.rand(32),
                }
            },
            "per_bucket_numel": {0: {(torch.bfloat16, torch.float32): [[32]]}},
        },
    }


def test_megatron_items_roundtrip_exactly():
    items = megatron_like()
    out, plan, buf, header = roundtrip(items)
    assert_same(items, out)
    m = out["model_optim_rng"]
    assert m["model"]["embedding.word_embeddings.weight"] is m["model"]["output_layer.weight"]
    assert isinstance(m["args"], argparse.Namespace) and m["args"].params_dtype is torch.bfloat16
    assert m["model_type"] is ModelType.encoder_or_decoder and m["signal"] is signal.SIGTERM
    assert type(m["model"]["decoder.final_layernorm.weight"]) is torch.nn.Parameter
    assert (torch.float32, torch.float32) in out["distrib_optim"][0]
    kinds = collections.Counter(e.kind for e in plan.tensors)
    assert kinds == {"tensor": 11, "parameter": 1, "ndarray": 1, "bytes": 1}
    # the RNG states are usable as such
    rng = m["rng_state"][0]
    random.setstate(rng["random_rng_state"])
    np.random.set_state(rng["np_rng_state"])
    torch.set_rng_state(rng["torch_rng_state"])
    assert (
        random.random()
        == (random.setstate(items["model_optim_rng"]["rng_state"][0]["random_rng_state"]), random.random())[1]
    )
    # the header is plain JSON naming the format version
    doc = json.loads(header)
    assert doc["version"] == FORMAT_VERSION and doc["format"] == "tiered_ckpt.flat"


def test_enum_of_a_module_not_imported_restores_as_stand_in():
    plan = plan_snapshot({"mt": ModelType.encoder_and_decoder, "local": enum.Enum("Color", "RED")["RED"]})
    doc = json.loads(encode_header(plan))
    assert "tabnanny" not in sys.modules, "pick a module this test process has not imported"
    doc["tree"]["kv"]["mt"].update(module="tabnanny", qualname="Outer.ModelType")
    info = decode_header(json.dumps(doc).encode())
    out = restore(info, torch.empty(0, dtype=torch.uint8))
    stand_in = out["mt"]
    assert stand_in == EnumStandIn("tabnanny", "Outer.ModelType", "encoder_and_decoder", 2)
    assert "tabnanny" not in sys.modules, "restore must never import"
    # an enum created at run time cannot be found by name either: also a stand-in
    assert isinstance(out["local"], EnumStandIn) and out["local"].name == "RED" and out["local"].value == 1
    # a stand-in encodes back to the same node
    again = json.loads(encode_header(plan_snapshot({"mt": stand_in})))
    assert again["tree"]["kv"]["mt"] == doc["tree"]["kv"]["mt"]


def test_namedtuple_defaultdict_and_memmap_narrowing(tmp_path):
    Point = collections.namedtuple("Point", "x y")
    mm = np.memmap(tmp_path / "a.bin", dtype="<f4", mode="w+", shape=(3,))
    mm[:] = [1, 2, 3]
    out, *_ = roundtrip({"p": Point(1, torch.ones(2)), "d": collections.defaultdict(list, a=[1]), "m": mm})
    assert type(out["p"]) is tuple and out["p"][0] == 1
    assert type(out["d"]) is dict and out["d"] == {"a": [1]}
    assert type(out["m"]) is np.ndarray and out["m"].tolist() == [1.0, 2.0, 3.0]


def test_odd_strings_big_ints_and_nan_payloads():
    items = {
        "\ud800lone": "\udfff",
        "émoji 🎉": "ü",
        "big": [2**63, -(2**63) - 1, 10**400, 2**53 - 1],
        "nans": NANS + [complex(NANS[0], -0.0)],
    }
    out, *_ = roundtrip(items)
    assert_same(items, out)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_every_available_dtype_including_sub_byte_ones():
    # every storable dtype the CPU build can hold, through raw bytes
    names = [
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "complex32",
        "complex64",
        "complex128",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
        "bits8",
        "bits16",
        "int4",
        "uint4",
        "uint1",
    ]
    items = {}
    for n in names:
        if hasattr(torch, n):
            dt = getattr(torch, n)
            raw = torch.arange(48, dtype=torch.uint8)
            if dt == torch.bool:
                raw &= 1
            items[n] = raw.view(dt)
    out, plan, *_ = roundtrip(items)
    for n, t in items.items():
        assert out[n].dtype == t.dtype and tensor_bytes(out[n]) == tensor_bytes(t), n


# ----------------------------------------------------------------------------------------------- errors


class Opaque:
    pass


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: {"state": {"optimizer": {"param_groups": [{"fn": lambda: 0}]}}},
            "state['optimizer']['param_groups'][0]['fn']: "
            "cannot encode object of type function without pickle",
        ),
        (
            lambda: {"state": [1, (2, Opaque())]},
            f"state[1][1]: cannot encode object of type {Opaque.__module__}.Opaque without pickle",
        ),
        (lambda: {"m": {"mod": sys}}, "m['mod']: cannot encode object of type module without pickle"),
        (
            lambda: {"s": {"a": torch.eye(2).to_sparse()}},
            "s['a']: cannot encode a tensor with layout torch.sparse_coo",
        ),
        (
            lambda: {"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)},
            "q: cannot encode a quantized",
        ),
        (lambda: {"x": {"m": torch.empty(2, device="meta")}}, "x['m']: cannot encode a meta tensor"),
        (
            lambda: {"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)},
            "n: cannot encode a nested tensor",
        ),
        (lambda: {"a": np.array([object()])}, "a: cannot encode an array of numpy dtype '|O' without pickle"),
        (
            lambda: {"k": {Opaque(): 1}},
            f"k: cannot encode dict key of type {Opaque.__module__}.Opaque without",
        ),
        (
            lambda: {"ns": argparse.Namespace(f=print)},
            "ns.f: cannot encode object of type builtin_function_or_method",
        ),
        (
            lambda: {"e": {"v": ModelType.encoder_or_decoder, "g": (x for x in [])}},
            "e['g']: cannot encode object",
        ),
        (lambda: {"st": {frozenset({1}), Opaque()}}, "st: cannot encode set element of type"),
        (lambda: [1, {2: [print]}], "[1][2][0]: cannot encode object of type builtin_function_or_method"),
    ],
)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_encode_error_names_the_key_path(make, message):
    with pytest.raises(EncodeError) as exc:
        plan_snapshot(make())
    assert str(exc.value).startswith(message), str(exc.value)


def test_encode_error_for_cycles_and_tensor_subclasses():
    cyc: list = []
    cyc.append(cyc)
    with pytest.raises(EncodeError, match="nested too deeply"):
        plan_snapshot({"c": cyc})

    class MyTensor(torch.Tensor):
        pass

    with pytest.raises(EncodeError, match=r"^t\[0\]: cannot encode tensor subclass"):
        plan_snapshot({"t": [torch.ones(2).as_subclass(MyTensor)]})


def valid_header():
    plan = plan_snapshot({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3), "n": 1})
    return plan, json.loads(encode_header(plan))


def mutate(fn):
    _, doc = valid_header()
    fn(doc)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (lambda: encode_header(valid_header()[0])[:-7], "not valid JSON"),
        (lambda: b"\xff\xfe{}", "not UTF-8"),
        (lambda: b"[1, 2]", "not a JSON object"),
        (lambda: b'{"x": NaN}', "not valid JSON"),
        (lambda: mutate(lambda d: d.update(version=99)), "unsupported version 99"),
        (lambda: mutate(lambda d: d.update(version=True)), "unsupported version True"),
        (lambda: mutate(lambda d: d.update(format="pickle")), "format is 'pickle'"),
        (lambda: mutate(lambda d: d["tensors"][1].update(offset=1024)), "beyond total_bytes"),
        (lambda: mutate(lambda d: d["tensors"][0].update(offset=32)), "not a multiple of 64"),
        (lambda: mutate(lambda d: d["tensors"][0].update(nbytes=-4)), "negative offset or size"),
        (lambda: mutate(lambda d: d["tensors"][0].update(shape=[2, -3])), "invalid shape"),
        (lambda: mutate(lambda d: d["tensors"][0].update(nbytes=20)), "shape and dtype need 24"),
        (lambda: mutate(lambda d: d["tensors"][0].update(dtype="float128")), "unknown dtype 'float128'"),
        (lambda: mutate(lambda d: d["tensors"][0].update(kind="pickle")), "unknown kind 'pickle'"),
        (lambda: mutate(lambda d: d["tensors"][0].pop("path")), "lacks field 'path'"),
        (lambda: mutate(lambda d: d["tensors"][0].update(path="other")), "fingerprint does not match"),
        (lambda: mutate(lambda d: d.update(total_bytes=-64)), "invalid total_bytes"),
        (
            lambda: mutate(lambda d: d["tree"]["kv"].update(n={"$": "lambda", "code": "x"})),
            r"tree node at \['n'\]: unknown node tag 'lambda'",
        ),
        (lambda: mutate(lambda d: d["tree"]["kv"].update(n={"v": 1})), "unknown node tag None"),
        (
            lambda: mutate(lambda d: d["tree"]["kv"].update(n={"$": "tensor", "i": 7})),
            "entry 7, which does not",
        ),
        (
            lambda: mutate(lambda d: d["tree"]["kv"].update(n={"$": "ndarray", "i": 0})),
            "refers to a 'tensor'",
        ),
        (
            lambda: mutate(lambda d: d["tree"]["kv"].update(n=[1, {"$": "bytes", "b64": "!!"}])),
            r"\['n'\]\[1\]: node 'bytes' holds invalid base64",
        ),
        (lambda: mutate(lambda d: d["tree"]["kv"].update(n={"$": "int", "hex": "12"})), "invalid int hex"),
        (lambda: mutate(lambda d: d.update(tree={"$": "dict", "items": [[[1], 2]]})), "cannot be a dict key"),
        (
            lambda: mutate(lambda d: d["tree"]["kv"].update(n={"$": "dtype", "v": "os.system"})),
            "unknown torch",
        ),
        (
            lambda: mutate(lambda d: d["tree"]["kv"].update(n={"$": "npscalar", "dtype": "|O", "b64": ""})),
            "unsupported numpy dtype",
        ),
        (lambda: mutate(lambda d: d.pop("tree")), "lacks field 'tree'"),
        (lambda: 12, "must be bytes or str"),
    ],
)
def test_decode_error_on_malformed_headers(data, match):
    with pytest.raises(DecodeError, match=match):
        decode_header(data())


def refingerprinted(doc: dict) -> bytes:
    """``doc`` with its fingerprint recomputed, as a tool (or an attacker) rewriting a header would."""
    from tiered_ckpt.codecs._flat_common import _fingerprint
    from tiered_ckpt.codecs._flat_header import _decode_entry

    with contextlib.suppress(DecodeError, TypeError, KeyError, AttributeError):  # a broken table stays broken
        entries = [_decode_entry(i, e, doc["total_bytes"], ALIGNMENT) for i, e in enumerate(doc["tensors"])]
        doc["fingerprint"] = _fingerprint(entries, doc["total_bytes"])
    return json.dumps(doc).encode()


def decode_and_restore(data: bytes, buffer: torch.Tensor) -> None:
    restore(decode_header(data), buffer)


def _absurd(index: int, **fields):
    def change(doc):
        doc["tensors"][index].update(fields)
    return change


def _absurd_array(doc):
    doc["tensors"].append({"path": "a", "kind": "ndarray", "offset": 0, "nbytes": 0, "np_dtype": "<f8",
                           "shape": [0, 2 ** 61]})


ABSURD = {
    # Each was a TypeError, RuntimeError or ValueError out of restore() (issue #15): sizes that agree with each
    # other (nbytes = 0) but overflow torch's and numpy's int64 sizes and strides.
    "a zero dim and one beyond int64": (_absurd(0, shape=[0, 2 ** 100], nbytes=0), "beyond any tensor's"),
    "strides beyond int64": (_absurd(0, shape=[0, 2 ** 62, 2 ** 62], nbytes=0), "beyond any tensor's"),
    "a last dim of 2**63": (_absurd(1, shape=[3, 0, 2 ** 63], nbytes=0), "beyond any tensor's"),
    "65 dimensions": (_absurd(1, shape=[1] * 64 + [0], nbytes=0), "65 dimensions"),
    "an array of 2**61 doubles per row": (_absurd_array, "beyond any tensor's"),
    "total_bytes beyond any buffer": (lambda d: d.update(total_bytes=1 << 80), "invalid total_bytes"),
    "offset beyond any buffer": (_absurd(1, offset=1 << 80), "beyond any buffer's"),
}


@pytest.mark.parametrize("name", list(ABSURD))
def test_absurd_sizes_in_a_header_are_decode_errors(name):
    change, match = ABSURD[name]
    plan, doc = valid_header()
    change(doc)
    with pytest.raises(DecodeError, match=match):
        decode_and_restore(refingerprinted(doc), torch.zeros(plan.total_bytes, dtype=torch.uint8))


HEADER_VALUES = (st.sampled_from([None, True, -1, 0, 1, 63, 64, 2 ** 31, 2 ** 53 + 1, 2 ** 62, 2 ** 63, 2 ** 64,
                                  1 << 80, 10 ** 400, 1.5, "", "float32", "bfloat16", "<f8", "|O", "tensor",
                                  "ndarray", "bytes", "cuda:99", "meta", [], [0], [0, 2 ** 63], [2 ** 40, 0, 2 ** 40],
                                  [1] * 70, {}, {"$": "tensor", "i": 0}, {"$": "size", "v": [2 ** 70]},
                                  {"$": "int", "v": "f" * 300}, {"$": "npdtype", "v": "V99999999999"}])
                 | st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                                lambda inner: st.lists(inner, max_size=3)
                                | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=5))
DIMS = st.sampled_from([0, 1, 2, 3, 2 ** 31, 2 ** 61, 2 ** 62, 2 ** 63, 2 ** 64, 2 ** 100])
ENTRY_FIELDS = ["path", "kind", "offset", "nbytes", "dtype", "shape", "device", "requires_grad", "np_dtype"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_header_changes_raise_only_decode_errors(data):
    """Random fields of a valid header replaced (the fingerprint recomputed): decoding and restoring either work
    or raise :class:`DecodeError`; nothing else escapes (the engine turns it into a fallback)."""
    plan = plan_snapshot({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16),
                          "n": np.arange(4.0), "blob": b"x" * 5000, "s": torch.Size([2, 3]), "i": 7})
    buf = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    copy_into(plan, buf)
    doc = json.loads(encode_header(plan))
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(["header", "entry", "tree"]))
        value = data.draw(HEADER_VALUES)
        if where == "header":
            doc[data.draw(st.sampled_from(["total_bytes", "alignment", "tensors", "version"]))] = value
        elif where == "entry" and isinstance(doc.get("tensors"), list) and doc["tensors"]:
            entry = doc["tensors"][data.draw(st.integers(0, len(doc["tensors"]) - 1))]
            if isinstance(entry, dict):
                field = data.draw(st.sampled_from(ENTRY_FIELDS + ["shape"] * 4))  # shapes: where torch overflows
                if field == "shape":
                    value = data.draw(st.lists(DIMS, max_size=6) | st.lists(st.just(1), min_size=60, max_size=70))
                    itemsize = 2 if entry.get("dtype") == "bfloat16" else 4 if entry.get("kind") == "tensor" else 8
                    entry["nbytes"] = math.prod(value) * itemsize  # sizes that agree: only the shape is absurd
                entry[field] = value
        elif isinstance(doc.get("tree"), dict) and isinstance(doc["tree"].get("kv"), dict):
            doc["tree"]["kv"][data.draw(st.sampled_from(["w", "b", "n", "blob", "s", "i"]))] = value
    with contextlib.suppress(DecodeError):
        decode_and_restore(refingerprinted(doc), buf)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_fast_path_of_a_table_entry_agrees_with_the_full_checks(data):
    """_plain_tensor_entry (thousands of entries per header) accepts only what _decode_entry accepts, and decodes
    it the same; anything else it leaves to _decode_entry."""
    from tiered_ckpt.codecs._flat_header import _decode_entry, _plain_tensor_entry

    plan = plan_snapshot({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16),
                          "p": torch.nn.Parameter(torch.ones(2, 2)), "z": torch.ones(0, 3)})
    doc = json.loads(encode_header(plan))
    entry = dict(data.draw(st.sampled_from(doc["tensors"])))
    for _ in range(data.draw(st.integers(0, 2))):
        field = data.draw(st.sampled_from(ENTRY_FIELDS + ["shape"]))
        if data.draw(st.booleans()) and field in entry:
            del entry[field]
        else:
            entry[field] = data.draw(HEADER_VALUES | st.lists(DIMS, max_size=4))
    fast = _plain_tensor_entry(entry, plan.total_bytes, 64)
    try:
        full = _decode_entry(0, entry, plan.total_bytes, 64)
    except DecodeError:
        assert fast is None
    else:
        assert fast is None or fast == full


def test_the_fast_path_takes_the_common_entries():
    from tiered_ckpt.codecs._flat_header import _plain_tensor_entry

    plan = plan_snapshot({"w": torch.arange(6.0).reshape(2, 3), "p": torch.nn.Parameter(torch.ones(2, 2))})
    doc = json.loads(encode_header(plan))
    assert [_plain_tensor_entry(e, plan.total_bytes, 64) for e in doc["tensors"]] == list(plan.tensors)


def test_deeply_nested_header_is_a_decode_error():
    deep = (
        '{"format":"tiered_ckpt.flat","version":1,"alignment":64,"total_bytes":0,"fingerprint":"x",'
        '"tensors":[],"tree":' + "[" * 100000 + "]" * 100000 + "}"
    )
    with pytest.raises(DecodeError):
        decode_header(deep.encode())


def test_restore_checks_the_buffer():
    plan, _ = valid_header()
    info = decode_header(encode_header(plan))
    with pytest.raises(DecodeError, match=f"holds {plan.total_bytes - 1} bytes but the snapshot needs"):
        restore(info, torch.zeros(plan.total_bytes - 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="1-D torch.uint8"):
        restore(info, torch.zeros(plan.total_bytes, dtype=torch.float32))
    with pytest.raises(TypeError, match="HeaderInfo"):
        restore(encode_header(plan), torch.zeros(plan.total_bytes, dtype=torch.uint8))


def test_copy_into_checks_the_destination():
    plan = plan_snapshot({"w": torch.ones(4, dtype=torch.float64)})
    with pytest.raises(ValueError, match="holds 63 bytes"):
        copy_into(plan, torch.zeros(63, dtype=torch.uint8))
    with pytest.raises(TypeError, match="1-D torch.uint8"):
        copy_into(plan, torch.zeros(64, dtype=torch.int8))
    with pytest.raises(ValueError, match="storage offset"):
        copy_into(plan, torch.zeros(128, dtype=torch.uint8)[4:])
    with pytest.raises(ValueError, match="stride 1"):
        copy_into(plan, torch.zeros(256, dtype=torch.uint8)[::2])


# ------------------------------------------------------------------------------------ zero copy, identity


def _inside(ptr: int, buf: torch.Tensor) -> bool:
    return buf.data_ptr() <= ptr < buf.data_ptr() + buf.numel()


def test_restore_without_copy_shares_the_buffer_and_with_copy_does_not():
    items = {
        "w": torch.randn(4, 4),
        "p": torch.nn.Parameter(torch.randn(3)),
        "a": np.arange(5, dtype="<i4"),
        "e": torch.zeros(2, 0),
    }
    for copy in (False, True):
        out, plan, buf, _ = roundtrip(items, copy=copy, buf_extra=128)
        ptrs = [out["w"].data_ptr(), out["p"].data_ptr(), out["a"].__array_interface__["data"][0]]
        assert [_inside(p, buf) for p in ptrs] == [not copy] * 3
        out["w"].zero_()  # the restored view writes through to the buffer, the copy does not
        e = plan.tensors[0]
        assert bool((buf[e.offset : e.offset + e.nbytes] == 0).all()) is (not copy)
    assert out["p"].requires_grad and out["p"].is_leaf and type(out["p"]) is torch.nn.Parameter


def test_restore_to_another_device_with_map_location():
    out, *_ = roundtrip({"w": torch.randn(3), "i": torch.arange(4)}, map_location="meta")
    assert out["w"].device.type == "meta" and out["i"].dtype == torch.int64


def test_restored_tensors_own_their_storage():
    """Views with storage offset 0 over their own slot: torch.save writes each tensor's bytes, not the slot's,
    and APIs that read from the storage start (torch.set_rng_state) see the right bytes."""
    state = torch.get_rng_state()
    out, plan, buf, _ = roundtrip({"big": torch.zeros(1 << 16), "rng": state})
    assert out["rng"].storage_offset() == 0 and out["rng"].untyped_storage().nbytes() == state.numel()
    assert _inside(out["rng"].data_ptr(), buf)
    torch.set_rng_state(out["rng"])
    assert torch.equal(torch.get_rng_state(), state)
    f = io.BytesIO()
    torch.save({"rng": out["rng"]}, f)
    assert len(f.getvalue()) < state.numel() + 4096  # not the 256 KiB slot
    # every dtype, shaped through numpy's views (float32, bool, complex) or torch's (bfloat16, float8)
    kinds = {"f": torch.randn(3, 5), "b": torch.randn(2, 4).to(torch.bfloat16), "m": torch.rand(7) > 0.5,
             "c": torch.randn(2, 2, dtype=torch.complex64), "e": torch.randn(6).to(torch.float8_e4m3fn),
             "p": torch.nn.Parameter(torch.randn(2, 3))}
    out, *_ = roundtrip(kinds)
    for k, t in kinds.items():
        got = out[k]
        assert got.storage_offset() == 0 and got.untyped_storage().nbytes() == t.numel() * t.element_size(), k
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got.view(torch.uint8),
                                                                              t.detach().view(torch.uint8)), k
    assert type(out["p"]) is torch.nn.Parameter and out["p"].requires_grad


def test_a_host_restore_buffer_at_an_odd_address_still_restores_exactly():
    """Host memory at an odd address: torch's views (numpy's only where every slot is aligned) give the values."""
    state = {"w": torch.randn(4), "b": torch.randn(3).to(torch.bfloat16), "i": torch.arange(5)}
    plan = plan_snapshot(state)
    buf = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    copy_into(plan, buf)
    shifted = torch.zeros(plan.total_bytes + 8, dtype=torch.uint8)
    shifted[1:1 + plan.total_bytes] = buf
    out = restore(decode_header(encode_header(plan)), shifted[1:], copy=True)
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_thousands_of_small_tensors():
    model = {f"layers.{i}.{n}": torch.empty(16) for i in range(500) for n in ("qkv", "proj", "fc1", "fc2")}
    items = {"model": model, "optimizer": {"state": {i: {"exp_avg": torch.empty(16)} for i in range(2000)}}}
    plan = plan_snapshot(items)
    header = encode_header(plan)
    buf = torch.empty(plan.total_bytes, dtype=torch.uint8)
    copy_into(plan, buf)
    assert len(plan.tensors) == 4000 and len(header) > 0
    assert all(e.offset % 64 == 0 for e in plan.tensors)
    assert len(restore(decode_header(header), buf)["model"]) == 2000


def test_tied_tensors_are_stored_once_and_restored_as_one_object():
    w = torch.randn(16, 8)
    p = torch.nn.Parameter(torch.randn(16))
    same_view = w.view(16, 8)  # another object, same storage/offset/shape/stride/dtype
    other_view = w[1:]
    c = torch.randn(4, dtype=torch.complex64)
    items = {
        "emb": w,
        "out": w,
        "alias": same_view,
        "p1": p,
        "p2": [p],
        "slice": other_view,
        "c": c,
        "c_conj": c.conj(),
    }
    out, plan, buf, _ = roundtrip(items)
    assert plan.total_bytes == 16 * 8 * 4 + 64 + 15 * 8 * 4 + 32 + 64 + 64  # w, p, w[1:], c, c.conj()
    assert len(plan.tensors) == 5
    assert torch.equal(out["c_conj"], c.conj()) and not torch.equal(out["c_conj"], c)
    assert out["emb"] is out["out"] is out["alias"]
    assert out["p1"] is out["p2"][0]
    assert out["slice"] is not out["emb"] and torch.equal(out["slice"], w[1:])
    # copies are independent objects but identity within one restore is kept
    out2, *_ = roundtrip(items, copy=True)
    assert out2["emb"] is out2["out"]


def test_entries_describe_the_slots():
    plan = plan_snapshot({"model": {"w": torch.ones(2, 3, dtype=torch.bfloat16)}, "rng": np.zeros(3, ">u4")})
    assert isinstance(plan, SnapshotPlan)
    w, rng = plan.tensors
    assert w == TensorEntry("model['w']", 0, 12, torch.bfloat16, (2, 3), "tensor", "cpu", False, None)
    assert rng == TensorEntry("rng", 64, 12, torch.uint8, (3,), "ndarray", "cpu", False, ">u4")
    assert plan.total_bytes == 128
    assert decode_header(encode_header(plan)).tensors == (w, rng)


# ---------------------------------------------------------------------------------------------- fingerprint


def _fp(items):
    return plan_snapshot(items).fingerprint


def test_fingerprint_tracks_the_layout_only():
    base = {"m": {"w": torch.zeros(4, 4), "b": torch.zeros(4)}, "it": 1, "args": argparse.Namespace(lr=0.1)}
    fp = _fp(base)
    assert fp == _fp(
        {
            "m": {"w": torch.randn(4, 4), "b": torch.ones(4).requires_grad_()},
            "it": 99,
            "args": argparse.Namespace(lr=0.5, extra="x"),
        }
    )  # values, non-tensor leaves and requires_grad do not move any slot
    assert fp != _fp({"m": {"w": torch.zeros(4, 4), "c": torch.zeros(4)}, "it": 1})  # key renamed
    assert fp != _fp({"m": {"w": torch.zeros(4, 5), "b": torch.zeros(4)}, "it": 1})  # shape
    assert fp != _fp(
        {"m": {"w": torch.zeros(4, 4, dtype=torch.float64), "b": torch.zeros(4)}, "it": 1}
    )  # dtype
    assert fp != _fp({"m": {"b": torch.zeros(4), "w": torch.zeros(4, 4)}, "it": 1})  # order => offsets
    assert decode_header(encode_header(plan_snapshot(base))).fingerprint == fp


# ------------------------------------------------------------------------------- planning again (PlanMemo)


def _planned_bytes(items, previous=None, dest=None):
    plan = plan_snapshot(items, previous=previous)
    buf = dest if dest is not None else torch.zeros(plan.total_bytes, dtype=torch.uint8)
    copy_into(plan, buf[:plan.total_bytes])
    return plan, encode_header(plan), buf[:plan.total_bytes].clone()


@SETTINGS
@given(structures, structures, st.sampled_from(["other", "same objects", "a deep copy"]))
def test_a_plan_made_with_another_plans_memo_is_the_plan_made_without(first, other, which):
    """Whatever the previous structure was (another one, the very same objects, or equal values elsewhere in
    memory), planning with its memo gives the same entries, header and bytes as planning afresh, into the same
    destination (so a stale copy list would show)."""
    import copy

    second = other if which == "other" else first if which == "same objects" else copy.deepcopy(first)
    fresh, header, data = _planned_bytes({"s": second})
    earlier = plan_snapshot({"s": first})
    dest = torch.zeros(max(fresh.total_bytes, earlier.total_bytes), dtype=torch.uint8)
    copy_into(earlier, dest[:earlier.total_bytes])  # the memo's copy list for this destination
    dest.zero_()
    if which == "a deep copy":
        _scribble(first)  # a copy list still reading the first structure's memory would now copy other bytes
    again, header2, data2 = _planned_bytes({"s": second}, previous=earlier.memo, dest=dest)
    assert again.tensors == fresh.tensors and again.fingerprint == fresh.fingerprint
    assert header2 == header and torch.equal(data2, data)


def _scribble(obj):
    if isinstance(obj, torch.Tensor):
        if obj.numel():
            # (a one-element tensor counts as contiguous whatever its stride: its flat view keeps that stride; a
            # conjugate or negative view cannot be viewed as bytes)
            plain = obj.is_contiguous() and not obj.is_conj() and not obj.is_neg()
            flat = obj.as_strided((obj.numel(),), (1,)) if plain else None
            with torch.no_grad():
                flat.view(torch.uint8).fill_(0x5A) if flat is not None else obj.zero_()
    elif isinstance(obj, np.ndarray):
        if obj.size and obj.flags.writeable:
            obj.reshape(-1).view(np.uint8).fill(0x5A) if obj.flags.c_contiguous and obj.dtype.itemsize else obj.fill(0)
    elif isinstance(obj, dict | list | tuple):
        for v in obj.values() if isinstance(obj, dict) else obj:
            _scribble(v)
    elif isinstance(obj, argparse.Namespace):
        _scribble(vars(obj))


def test_the_same_structure_reuses_the_layout_and_follows_new_values():
    w = torch.randn(64, 64)
    items = {"m": {"w": w, "b": torch.zeros(64)}, "it": 1}
    dest = torch.zeros(plan_snapshot(items).total_bytes, dtype=torch.uint8)
    first = plan_snapshot(items)
    copy_into(first, dest)
    w.add_(1)  # same memory, new values: the copy list is reused
    items["it"] = 2  # a value in the tree
    items["m"]["b"] = torch.ones(64)  # a new tensor, elsewhere in memory: its copy is planned again
    second = plan_snapshot(items, previous=first.memo)
    assert second.tensors is first.tensors and second.memo.tensors_json is first.memo.tensors_json
    copy_into(second, dest)
    out = restore(decode_header(encode_header(second)), dest)
    assert torch.equal(out["m"]["w"], w) and torch.equal(out["m"]["b"], torch.ones(64)) and out["it"] == 2
    assert encode_header(second) == encode_header(plan_snapshot(items))


def test_a_changed_structure_is_planned_again():
    items = {"a": torch.zeros(8), "b": torch.zeros(8)}
    memo = plan_snapshot(items).memo
    for changed in ({"a": torch.zeros(8), "b": torch.zeros(9)}, {"b": torch.zeros(8), "a": torch.zeros(8)},
                    {"a": torch.zeros(8)}, {"a": torch.zeros(8), "b": torch.zeros(8), "c": torch.zeros(1)},
                    {"a": torch.zeros(8), "b": torch.zeros(8, dtype=torch.float64)},
                    {"a": torch.zeros(8), "b": torch.nn.Parameter(torch.zeros(8))}):
        plan = plan_snapshot(changed, previous=memo)
        assert plan.tensors == plan_snapshot(changed).tensors
        assert plan.fingerprint == plan_snapshot(changed).fingerprint


def test_a_memo_keeps_the_copy_lists_of_a_few_destinations_only():
    items = {"w": torch.randn(256)}
    plan = plan_snapshot(items)
    buffers = [torch.zeros(plan.total_bytes, dtype=torch.uint8) for _ in range(9)]
    for buf in buffers:
        plan = plan_snapshot(items, previous=plan.memo)
        copy_into(plan, buf)
        assert torch.equal(restore(decode_header(encode_header(plan)), buf)["w"], items["w"])
    assert 1 <= len(plan.memo.copies) <= 4


def test_a_memo_keeps_no_tensor_alive():
    import gc
    import weakref

    t = torch.randn(1024)
    ref = weakref.ref(t)
    plan = plan_snapshot({"t": t})
    copy_into(plan, torch.zeros(plan.total_bytes, dtype=torch.uint8))
    memo = plan.memo
    del plan, t
    gc.collect()
    assert ref() is None and memo.copies  # the copy list is kept, as addresses only


# ---------------------------------------------------------------------------------------------- copy_into


def test_copy_into_reuses_views_and_follows_a_new_destination():
    items = {"w": torch.randn(5, 3).t(), "c": torch.randn(3, dtype=torch.complex64)}
    plan = plan_snapshot(items)
    a = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    b = torch.zeros(plan.total_bytes + 64, dtype=torch.uint8)[64:]
    copy_into(plan, a)
    items["w"].add_(1)
    copy_into(plan, a)
    copy_into(plan, b)
    info = decode_header(encode_header(plan))
    for buf in (a, b):
        out = restore(info, buf)
        assert torch.equal(out["w"], items["w"]) and torch.equal(out["c"], items["c"])


def test_copy_into_does_not_record_autograd_history():
    p = torch.nn.Parameter(torch.randn(4))
    plan = plan_snapshot({"p": p})
    buf = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    copy_into(plan, buf)
    assert not buf.requires_grad and buf.grad_fn is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sources_into_pinned_host_and_device_buffers():
    items = {
        "w": torch.randn(1024, 256, device="cuda"),
        "h": torch.randn(7),
        "b": torch.ones(3, device="cuda").bool(),
    }
    plan = plan_snapshot(items)
    assert plan.tensors[0].device == "cuda:0"
    header = encode_header(plan)
    for dest in (
        torch.empty(plan.total_bytes, dtype=torch.uint8).pin_memory(),
        torch.empty(plan.total_bytes, dtype=torch.uint8, device="cuda"),
    ):
        copy_into(plan, dest)
        out = restore(decode_header(header), dest)
        assert out["w"].device == dest.device
        for k, t in items.items():
            assert torch.equal(out[k].cpu(), t.cpu()), k
        back = restore(decode_header(header), dest, copy=True, map_location="cpu")
        assert back["w"].device.type == "cpu" and torch.equal(back["w"], items["w"].cpu())


# ------------------------------------------------------------------------------- placement


def _asked(placement):
    calls = []

    def ask():
        calls.append(1)
        return placement
    return ask, calls


def test_a_placement_puts_the_tensors_it_names_at_its_offsets_modulo_a_page():
    """Named tensors start at the asked offset modulo PLACEMENT_MODULUS, after a gap of less than a page; a wish
    the 64-byte alignment cannot meet, or out of range, is ignored; the bytes restore exactly."""
    a, b, c, d = torch.randn(1000), torch.randn(3000), torch.arange(5, dtype=torch.int64), torch.randn(7)
    items = {"a": a, "b": b, "c": c, "d": d}
    ask, calls = _asked({id(b): 1344, id(c): 4032, id(d): 100, id(a): PLACEMENT_MODULUS})
    plan = plan_snapshot(items, placement=ask)
    at = {e.path: e.offset for e in plan.tensors}
    unplaced = {e.path: e.offset for e in plan_snapshot(items).tensors}
    assert at["a"] == unplaced["a"] == 0  # out of range: ignored
    assert at["b"] % PLACEMENT_MODULUS == 1344 and at["b"] - (4000 + 32) < PLACEMENT_MODULUS
    assert at["c"] % PLACEMENT_MODULUS == 4032 and at["c"] > at["b"]
    assert at["d"] % ALIGNMENT == 0 and at["d"] == at["c"] + 64  # 100: not a multiple of 64, ignored
    assert calls == [1]
    buf = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    copy_into(plan, buf)
    out = restore(decode_header(encode_header(plan)), buf)
    for k, v in items.items():
        assert torch.equal(out[k], v)


def test_a_plan_that_reuses_the_last_one_keeps_its_placement_without_asking():
    w, m = torch.randn(500), torch.randn(600)
    items = {"w": w, "m": m, "step": 1}
    first = plan_snapshot(items, placement=_asked({id(m): 2048})[0])
    ask, calls = _asked({id(m): 1024})  # a placement that changed while the structure did not: not asked
    again = plan_snapshot({"w": w, "m": m, "step": 2}, previous=first.memo, placement=ask)
    assert again.tensors == first.tensors and calls == []
    fresh_memory = {"w": torch.randn(500), "m": torch.randn(600), "step": 3}  # same facts, new tensors
    ask, calls = _asked({id(fresh_memory["m"]): 2048})
    third = plan_snapshot(fresh_memory, previous=first.memo, placement=ask)
    assert third.tensors == first.tensors and calls == []


def test_a_changed_structure_is_placed_anew():
    """Once a tensor differs from the last plan's, the placement is asked and met from there on."""
    w, m = torch.randn(500), torch.randn(600)
    first = plan_snapshot({"w": w, "m": m}, placement=_asked({id(m): 3072})[0])
    grown = {"w": torch.randn(501), "m": m}
    ask, calls = _asked({id(m): 1024})
    placed = plan_snapshot(grown, previous=first.memo, placement=ask)
    assert calls == [1] and placed.tensors[1].offset % PLACEMENT_MODULUS == 1024
    assert placed.fingerprint != first.fingerprint
